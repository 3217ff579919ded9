"""The consumers' streamed statistics, and the local-imitation error curves computed from them.

A consumer's Gram matrix costs D² multiply-adds per position (D = input channels x kernel taps); past
``STATS_GRAM_MACS`` (the refit's) or ``CURVE_GRAM_MACS`` (the allocation's curves) its statistics take every
k-th position, counted across samples so that all contribute. The curves need the shape of each layer's loss,
the refit more: MobileNetV2's largest consumer costs 8.3e9 on the curves' 128 samples and 3.3e10 on 500 photos,
so neither budget touches it; a 3x3 conv of YOLOv8n at 320 costs 1.4e11 on 64 photos.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
import torch

from onnxprune.analysis import consumers
from onnxprune.ir.cuts import in_graph_layout
from onnxprune.analysis.groups import ConsumerUse, Group
from onnxprune.core.context import ConsumerData, Context, Progress
from onnxprune.imitation.local import greedy_local
from onnxprune.imitation.gram import ConsumerStats, Scratch, neuron_gram
from onnxprune.ops.registry import lookup

CURVE_GRAM_MACS = 10**10
STATS_GRAM_MACS = 5 * 10**10
STATS_BYTES = 2 << 30  # a statistics chunk's unfolded inputs and targets, at most (the run's plan may lower it)


def collect(graph: gs.Graph, original: gs.Graph, group: Group, prefix: dict[str, np.ndarray],
            reference: dict[str, np.ndarray], batch_size: int, kept_rows: dict[str, np.ndarray],
            uses: list[ConsumerUse] | None = None, chunk_bytes: int = STATS_BYTES,
            weights: np.ndarray | None = None) -> list[ConsumerData]:
    """Streamed statistics of every consumer of ``group`` (or of ``uses``): inputs on the ``prefix`` network
    (``graph``, the pruned one) vs outputs of the ``original`` network (its cached tensors ``reference``),
    ``batch_size`` samples a chunk, unfolded a few samples at a time so that a chunk's unfolded inputs and targets
    hold at most ``chunk_bytes`` (a 3x3 conv at 256x256 unfolds to ~0.5 GB a sample): the folds do not depend on it,
    the sums only by float rounding. ``kept_rows``: a stream producer's original output rows still there.

    A consumer that also reads other groups' channels (a Concat) is seen through the group's
    columns only; the other columns' contribution, with their current weights, leaves the target. ``weights``: a
    map per sample (``strategies.objects.object_weights``) that weighs each output position of a consumer whose
    positions form a grid of the map's shape (``position_weights``); the others' positions weigh alike."""
    nodes_p = {n.name: n for n in graph.nodes}
    ranks = {name: len(t.shape) for name, t in graph.tensors().items() if t.shape is not None}
    nodes_o = {n.name: n for n in original.nodes}
    out = []
    n = len(next(iter(prefix.values())))
    # Chunks alternate between the two folds of the refit's cross-validation; an even size keeps
    # an image and its mirror (adjacent with --flip) in the same fold.
    bs = max(2, min(batch_size, n // 2) // 2 * 2)
    for use in group.consumers if uses is None else uses:
        node_p, node_o = nodes_p[use.node], nodes_o[use.node]
        full_p, full_o = consumers.matrix(node_p), consumers.matrix(node_o)
        channels = len(full_o.weight)
        view = consumers.group_view(graph, node_p, group, use)
        current = view.linear(full_p)
        kept = kept_rows.get(use.node)  # a stream producer whose outputs were sliced already
        if kept is not None:
            full_o = consumers.Linear(full_o.weight[kept], full_o.bias[kept], full_o.k)
        target = consumers.group_view(original, node_o, group, use).linear(full_o)
        w_o = torch.from_numpy(full_o.weight.astype(np.float32))
        b_o = torch.from_numpy(full_o.bias.astype(np.float32))
        w_rest = torch.from_numpy(full_p.weight[:, view.rest].astype(np.float32))
        partner = _residual_partner(node_o)
        if partner is not None and partner not in prefix:
            partner = None
        out_axis = lookup(node_o.op).mixing.axis(node_o)  # the consumer's output channels (a MatMul's: the last)
        folds = tuple(ConsumerStats(*current.weight.shape[::-1]) for _ in range(2))
        x_p, x_o = prefix[use.tensor], reference[use.tensor]
        same = x_p is x_o and node_p.op == node_o.op and node_p.attrs == node_o.attrs  # the probes': unfold once
        rank = ranks.get(use.tensor, x_p.ndim)
        folded = x_p.shape[1] if x_p.ndim == rank + 1 else 1  # rows a sample folded into the batch (cut_graph)
        length = folded * consumers.positions(node_p, x_p.shape[1:] if folded > 1 else x_p.shape)
        stride = _stride(current.weight.shape[1], length * len(x_p), STATS_GRAM_MACS)
        sub = consumers.samples_per_chunk(node_o, channels, full_p.weight.shape[1] + full_o.weight.shape[1] + len(w_o),
                                          bs, chunk_bytes)
        if weights is not None and len(weights) != len(x_p):
            raise ValueError(f"{len(weights)} weight maps for {len(x_p)} samples: name the samples (collect's samples)")
        grid = None if weights is None else grid_of(length, weights.shape[1:])
        targets, operands = Scratch(), Scratch()  # reused by every chunk (see Scratch)
        for s in (s for start in range(0, len(x_p), bs) for s in range(start, min(start + bs, len(x_p)), sub)):
            e = min(s + sub, s // bs * bs + bs)  # a sub-chunk stays within its fold's chunk
            first = -s * length % stride
            x = consumers.unfold_every(node_p, _float(in_graph_layout(x_p[s:e], rank)), stride, first)
            x_t = x if same else consumers.unfold_every(node_o, _float(in_graph_layout(x_o[s:e], rank)), stride, first)
            t = torch.matmul(w_o, x_t, out=targets.take((x.shape[0], len(w_o), x.shape[2])))
            t += b_o[:, None]
            if view.rest.size:
                t -= torch.matmul(w_rest, view.take_rest(x))
            x = view.take(x)
            if partner is not None:
                ref = in_graph_layout(reference[partner][s:e], ranks.get(partner, -1))
                shift = ((ref if kept is None else np.take(ref, kept, axis=out_axis))
                         - in_graph_layout(prefix[partner][s:e], ranks.get(partner, -1)))
                t += consumers.thin(consumers.columns(node_o, _float(shift)), stride, first)
            weight = None if grid is None else position_weights(weights[s:e], grid, stride, first)
            folds[(s // bs) % 2].update(x, t, operands, weight)
        stats = ConsumerStats(*current.weight.shape[::-1])
        for fold in folds:
            stats.merge(fold)
        out.append(ConsumerData(use, folds, stats, current, target))
    return out


def _float(a: np.ndarray) -> torch.Tensor:
    """A cached tensor as float32 (a float16 model's activations: the statistics accumulate in float32/64)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def grid_of(positions: int, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """The (height, width) of ``positions`` output positions laid out as a map of ``shape``'s proportions (a
    conv's output of an image, at any stride), or None where they do not form one."""
    h = max(1, round(math.sqrt(positions * shape[0] / shape[1])))
    w = positions // h
    if h * w != positions or abs(h / w - shape[0] / shape[1]) > 1 / min(h, w):
        return None
    return h, w


def position_weights(maps: np.ndarray, grid: tuple[int, int], stride: int, first: int) -> torch.Tensor:
    """The weight of each kept position (every ``stride``-th from ``first``, counted across the samples, as
    ``consumers.thin`` keeps them) of outputs laid out as ``grid``: the samples' ``maps`` averaged over the cells
    of a coarser grid, the nearest cell's of a finer one."""
    m = torch.from_numpy(np.ascontiguousarray(maps, dtype=np.float32))[:, None]
    finer = grid[0] * grid[1] > m.shape[2] * m.shape[3]
    m = torch.nn.functional.interpolate(m, size=grid, mode="nearest" if finer else "area")
    return consumers.thin(m.reshape(len(m), 1, -1), stride, first)[:, 0]


def error_curves(ctx: Context, order: list[tuple[int, Group]], on_layer: Progress | None = None
                 ) -> dict[int, np.ndarray]:
    """Relative local-imitation loss at every width (best over widths ≤ n) for each group,
    measured on the original network in one pass over ``curve_samples`` evenly spaced
    calibration samples, positions thinned past ``CURVE_GRAM_MACS`` (the allocation needs the
    curves' shape, not the refit's precision)."""
    n_samples = len(next(iter(ctx.inputs.values())))
    step = max(1, -(-n_samples // ctx.options.curve_samples))
    values = {name: np.ascontiguousarray(v[::step]) for name, v in ctx.inputs.items()}
    nodes = {n.name: n for n in ctx.original.nodes}
    curves = {}
    for i, (cut, group) in enumerate(order):
        if on_layer is not None:
            on_layer(i, len(order), f"error curve of {group.name}")
        ctx.advance(ctx.original, values, cut)
        # On the unpruned network both targets are the layer's own output, so the Gram matrix
        # alone defines the loss: no output statistics are needed.
        pairs = []
        ahead = ctx.peek(ctx.original, values, {use.tensor for use in group.consumers})
        for use in group.consumers:
            node = nodes[use.node]
            view = consumers.group_view(ctx.original, node, group, use)
            lin = view.linear(consumers.matrix(node))
            stats = ConsumerStats(lin.weight.shape[1], 0)
            x = ahead[use.tensor]
            length = consumers.positions(node, x.shape)
            stride = _stride(lin.weight.shape[1], length * len(x), CURVE_GRAM_MACS)
            sub = consumers.samples_per_chunk(node, *consumers.matrix(node).weight.shape, ctx.options.batch_size,
                                              ctx.stats_bytes)
            for s in range(0, len(x), sub):
                cols = view.take(consumers.unfold_every(node, torch.from_numpy(x[s : s + sub]), stride,
                                                        -s * length % stride))
                stats.update(cols, cols[:, :0])
            pairs.append((stats, lin.weight, lin.k))
        curves[group.id] = local_curve(pairs, group.channels)
    return curves


def _residual_partner(node: gs.Node) -> str | None:
    """The other input of a residual Add that the consumer's output feeds into, if any."""
    out = node.outputs[0]
    if len(out.outputs) != 1 or out.outputs[0].op != "Add":
        return None
    add = out.outputs[0]
    others = [t for t in add.inputs if t is not out]
    if len(others) != 1 or isinstance(others[0], gs.Constant) or others[0].shape != out.shape:
        return None
    return others[0].name


def _stride(d: int, positions: int, budget: int) -> int:
    """Every how many positions a Gram matrix of ``d`` columns keeps to cost at most ``budget`` multiply-adds."""
    return max(1, -(-d * d * positions // budget))


def local_curve(pairs: list[tuple[ConsumerStats, np.ndarray, int]], n: int) -> np.ndarray:
    """Relative local-imitation loss by width; on the unpruned network both targets are the layer's
    own output, so the Gram matrix alone defines it."""
    G = sum(neuron_gram(stats.xx, w, k) for stats, w, k in pairs)
    tau = float(G.sum()) / n**2
    path = greedy_local(G, G.sum(axis=1) / n, tau)
    curve = np.minimum.accumulate(np.where(np.isfinite(path.curve), path.curve, np.inf)[1:])
    return np.concatenate([[np.inf], curve / max(tau, np.finfo(float).tiny)])
