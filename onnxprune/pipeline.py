"""``compress``: layer-wise channel pruning of an ONNX model on calibration data.

Groups are pruned in graph order. At each group's cut (just before its first consumer) the
calibration set has been pushed through the already-pruned prefix and, in lockstep, through the
original network. The consumers' unfolded inputs (pruned prefix) and outputs (original network)
are reduced to streamed statistics, from which the greedy chooses the channels and the
reconstruction chooses the consumer weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.allocation import curve_widths, epsilon_widths, group_step, lowest_macs, uniform_widths
from onnxprune.analysis import Analysis, analyze, consumers
from onnxprune.analysis.graph import infer_shapes, static_shape
from onnxprune.analysis.groups import ConsumerUse, Group, kept_entries
from onnxprune.analysis.macs import count_params
from onnxprune.calib.sources import CalibrationSet
from onnxprune.cost import CostTable, measure_cost_table, median_latencies
from onnxprune.errors import AnalysisError, CalibrationError, TargetError, check_choice
from onnxprune.imitation.downstream import DownstreamObjective
from onnxprune.imitation.global_ import greedy_global
from onnxprune.imitation.local import greedy_local
from onnxprune.imitation.omp import centred, group_omp
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import centred_energy, quadratic_loss_full, refit_cv, refit_scale
from onnxprune.imitation.stats import ConsumerStats, neuron_cross, neuron_gram, target_energy
from onnxprune.passes import refit_consumer, scale_columns, slice_channels
from onnxprune.runtime.ort import first_provider
from onnxprune.runtime.probe import FixedBatch, fixed_batch
from onnxprune.runtime.segments import Liveness, run_segment

METHODS = ("local", "omp", "global", "l1", "random")
TARGETS = ("original", "paper")
RECONSTRUCTIONS = ("none", "scale", "full")
ALLOCATIONS = ("uniform", "epsilon", "curve")
# A consumer's Gram matrix costs D² multiply-adds per position (D = input channels x kernel taps); past
# these budgets its statistics take every k-th position (counted across samples, so all contribute). The error
# curves of the allocation need the shape of each layer's loss, the refit more: MobileNetV2's largest
# consumer costs 8.3e9 on the curves' 128 samples and 3.3e10 on 500 photos, so neither budget touches it;
# a 3x3 conv of YOLOv8n at 320 costs 1.4e11 on 64 photos.
CURVE_GRAM_MACS = 10**10
STATS_GRAM_MACS = 5 * 10**10
OMP_RIDGE = 1e-4  # of the group OMP's least squares, relative to the trace (as the refit's smallest)


@dataclass
class CompressOptions:
    """What to prune and how. Exactly one of ``target_macs`` / ``target_ratio`` / ``target_latency_ms`` /
    ``target_latency_ratio`` is set."""

    target_macs: float | None = None
    target_ratio: float | None = None
    # A latency budget (ms, or a fraction of the original's measured latency) spent through a cost table
    # measured on ``provider`` at ``latency_batch`` with ``threads`` intra-op threads, or read from ``cost_table``.
    target_latency_ms: float | None = None
    target_latency_ratio: float | None = None
    latency_batch: int = 1
    threads: int | None = None
    cost_table: str | None = None
    save_cost_table: str | None = None
    method: str = "omp"
    target: str = "original"
    reconstruct: str = "full"
    allocation: str = "epsilon"
    ridge: float = 1e-4  # of the per-channel "scale" refit; the full refit cross-validates its own
    min_channels: int = 1
    round_to: int = 8
    curve_samples: int = 128  # calibration samples (evenly spaced) for the allocation's error curves
    batch_size: int = 32
    provider: str = "auto"
    seed: int = 0
    best_effort: bool = False  # a budget below the lowest reachable MACs prunes to those instead of failing

    def __post_init__(self) -> None:
        for name, choices in (("method", METHODS), ("target", TARGETS), ("reconstruct", RECONSTRUCTIONS),
                              ("allocation", ALLOCATIONS)):
            check_choice(name, getattr(self, name), choices)


@dataclass
class LayerReport:
    group: str
    channels: int
    kept: int
    consumers: list[str]
    imitation_loss: float | None  # relative loss of the greedy's simplex solution (local only)
    error_fold: float  # relative output error of the consumers before the refit
    error: float  # relative output error of the consumers as written
    ridges: list[float]  # refit ridge per consumer, chosen by cross-validation (full reconstruction)
    seconds: float
    step: int  # widths were multiples of this: --round-to, or finer for a group narrower than 4 steps


@dataclass
class LatencyReport:
    """A latency target: what the cost table predicted and what the final benchmark measured."""

    target_ms: float
    target_ratio: float | None  # a target given as a fraction of the original's latency
    predicted_ms: float  # the cost table's prediction for the chosen widths
    measured_ms: float  # the written model, timed in rounds with the original
    original_ms: float
    met: bool  # measured ≤ target (a ratio target: measured / original ≤ the ratio, both timed together)
    provider: str
    batch: int
    threads: int | None
    requested_ms: float | None  # the target asked for, when best_effort raised it to the lowest reachable
    table: dict  # the cost table (see onnxprune.cost)
    table_seconds: float  # 0 when read from a file
    table_machine: str | None  # read from a file measured on another machine: what differs


@dataclass
class CompressReport:
    macs_before: int
    macs_after: int
    params_before: int
    params_after: int
    target_macs: float
    options: dict
    provider: str
    calibration_samples: int
    seconds: float = 0.0
    layers: list[LayerReport] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    requested_macs: float | None = None  # the budget asked for, when best_effort raised it to the lowest reachable
    latency: LatencyReport | None = None  # with a latency target (target_macs: the MACs its widths come to)
    fixed_batch: dict | None = None  # {"size", "reason"}: the graph fixes its batch, calibration ran at that batch

    def to_dict(self) -> dict:
        return asdict(self)


def schedule(analysis: Analysis, live: Liveness) -> tuple[list[tuple[int, Group]], list[dict]]:
    """Prunable groups with their cut (position of the first consumer), and those left alone.

    A group can be pruned layer-wise when all of its producers run before its first consumer, or when
    those that run later are gates (squeeze-excite: one value per channel and sample, computed from the
    group's pooled channels by its first consumer); residual streams, tied across several layers, cannot
    yet. Consumers that read the channels later (through a Concat or the gate) are fed by running ahead
    from the cut (``peek``).
    """
    order, skipped = [], []
    nodes = {n.name: n for n in analysis.graph.nodes}
    for g in analysis.groups:
        if not g.prunable:
            skipped.append({"group": g.name, "channels": g.channels, "reason": g.reason})
            continue
        cut = min(live.position[c.node] for c in g.consumers)
        if any(live.position[p] >= cut and not _is_gate(nodes[p]) for p in g.producers):
            skipped.append({"group": g.name, "channels": g.channels,
                            "reason": "coupled across layers (residual/SE): not pruned by this release"})
            continue
        order.append((cut, g))
    # An SE reducer's own group is cut at the gate producer, after the gated group sliced that producer's
    # rows: its statistics would no longer match the original's outputs.
    gates = {p: g for cut, g in order for p in g.producers if live.position[p] >= cut}
    for cut, g in list(order):
        gated = next((gates[c.node] for c in g.consumers if c.node in gates and gates[c.node] is not g), None)
        if gated is not None:
            order.remove((cut, g))
            skipped.append({"group": g.name, "channels": g.channels,
                            "reason": f"reduces the pooled channels of the gated group {gated.name}, pruned before it: "
                                      "not pruned"})
    order.sort(key=lambda item: item[0])
    if not order:
        if not skipped:
            raise AnalysisError("no prunable channel group in this graph: no channels run from a Conv, ConvTranspose, "
                                "Gemm or MatMul to another")
        reasons = list(dict.fromkeys(s["reason"] for s in skipped))
        shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
        groups = f"{len(skipped)} group" + "s" * (len(skipped) > 1)
        raise AnalysisError(f"no prunable channel group in this graph ({groups}: {shown}); "
                            "`onnxprune analyze` lists every group")
    return order, skipped


def _is_gate(node: gs.Node) -> bool:
    """A producer with one value per channel and sample (an SE excitation conv on a pooled map, or a Gemm)."""
    shape = static_shape(node.outputs[0])
    return shape is not None and len(shape) >= 2 and all(d == 1 for d in shape[2:])


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


@dataclass
class _ConsumerData:
    use: ConsumerUse
    folds: tuple[ConsumerStats, ConsumerStats]  # alternate batches, for choosing the refit's ridge
    stats: ConsumerStats  # both folds
    current: consumers.Linear
    original: consumers.Linear


class Compressor:
    """Holds both graphs and their cached live tensors while pruning group by group."""

    def __init__(self, model: onnx.ModelProto, calib: CalibrationSet, options: CompressOptions) -> None:
        self.model = model
        self.options = options
        self.analysis = analyze(model)
        self.original = self.analysis.graph.copy()
        self.graph = self.analysis.graph
        self.live = Liveness(self.graph)
        self.rng = np.random.default_rng(options.seed)
        self.inputs = self._load(calib)
        if len(next(iter(self.inputs.values()))) < 2:
            raise CalibrationError("compress needs at least 2 calibration samples (the refit cross-validates)")
        self.values_p = dict(self.inputs)
        self.values_o = dict(self.inputs)
        self.fixed_batch = fixed_batch(gs.export_onnx(self.original.copy()), self.inputs)
        # A graph that writes its batch into the graph runs as exported; the statistics still batch freely.
        self.run_batch = options.batch_size if self.fixed_batch is None else self.fixed_batch.size
        self.provider = options.provider
        self.reference: dict[str, np.ndarray] | None = None  # original outputs, for global imitation

    def _load(self, calib: CalibrationSet) -> dict[str, np.ndarray]:
        parts: dict[str, list[np.ndarray]] = {}
        for batch in calib.batches(self.options.batch_size):
            for name, array in batch.items():
                parts.setdefault(name, []).append(array)
        if not parts:
            raise CalibrationError("the calibration set is empty: give a folder or file with samples")
        return {name: np.concatenate(arrays) for name, arrays in parts.items()}

    def advance(self, graph: gs.Graph, values: dict[str, np.ndarray], cut: int) -> None:
        """Bring the cached tensors of ``graph`` to those live at ``cut`` (in place)."""
        live = self.live.live(cut)
        new, ran = run_segment(graph, values, live - set(values), provider=self.options.provider,
                               batch_size=self.run_batch, exact=self.fixed_batch is not None)
        self.provider = ran or self.provider
        values.update(new)
        for name in set(values) - live:
            del values[name]

    def quadratic(self, group: Group, data: list[_ConsumerData]) -> tuple[np.ndarray, np.ndarray, float]:
        """(G, c, tau) of the local imitation loss aᵀGa - 2cᵀa + tau for the configured target."""
        n = group.channels
        G = sum(neuron_gram(d.stats.xx, d.current.weight, _k(d)) for d in data)
        if self.options.target == "paper":
            return G, G.sum(axis=1) / n, float(G.sum()) / n**2
        c = sum(neuron_cross(d.stats.xt, d.stats.sx, d.current.weight, _k(d), d.original.bias) for d in data) / n
        tau = sum(target_energy(d.stats.tt, d.stats.st, d.stats.count, d.original.bias) for d in data) / n**2
        return G, c, tau

    def error_curves(
        self, order: list[tuple[int, Group]], on_layer: Callable[[int, int, str], None] | None = None
    ) -> dict[int, np.ndarray]:
        """Relative local-imitation loss at every width (best over widths ≤ n) for each group,
        measured on the original network in one pass over ``curve_samples`` evenly spaced
        calibration samples, positions thinned past ``CURVE_GRAM_MACS`` (the allocation needs the
        curves' shape, not the refit's precision)."""
        n_samples = len(next(iter(self.inputs.values())))
        step = max(1, -(-n_samples // self.options.curve_samples))
        values = {name: np.ascontiguousarray(v[::step]) for name, v in self.inputs.items()}
        nodes = {n.name: n for n in self.original.nodes}
        curves = {}
        for i, (cut, group) in enumerate(order):
            if on_layer is not None:
                on_layer(i, len(order), f"error curve of {group.name}")
            self.advance(self.original, values, cut)
            # On the unpruned network both targets are the layer's own output, so the Gram matrix
            # alone defines the loss: no output statistics are needed.
            pairs = []
            ahead = self.peek(self.original, values, {use.tensor for use in group.consumers})
            for use in group.consumers:
                node = nodes[use.node]
                view = consumers.group_view(self.original, node, group, use)
                lin = view.linear(consumers.matrix(node))
                stats = ConsumerStats(lin.weight.shape[1], 0)
                x = ahead[use.tensor]
                stride = 1
                for s in range(0, len(x), self.options.batch_size):
                    cols = view.take(consumers.unfold(node, torch.from_numpy(x[s : s + self.options.batch_size])))
                    if s == 0:
                        stride = _stride(cols.shape[1], cols.shape[2] * len(x), CURVE_GRAM_MACS)
                    cols = _thin(cols, stride, -s * cols.shape[2] % stride)
                    stats.update(cols, cols[:, :0])
                pairs.append((stats, lin.weight, lin.k))
            curves[group.id] = _local_curve(pairs, group.channels)
        return curves

    def peek(self, graph: gs.Graph, values: dict[str, np.ndarray], names: set[str]) -> dict[str, np.ndarray]:
        """``values`` plus the tensors ``names`` not cached yet, computed ahead (not kept in the cache)."""
        new, ran = run_segment(graph, values, names - set(values), provider=self.options.provider,
                               batch_size=self.run_batch, exact=self.fixed_batch is not None)
        self.provider = ran or self.provider
        return {**values, **new}

    def collect(self, group: Group, prefix: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                uses: list[ConsumerUse] | None = None) -> list[_ConsumerData]:
        """Streamed statistics of every consumer: inputs on the ``prefix`` network (the pruned one)
        vs outputs of the original network (its cached tensors ``reference``).

        A consumer that also reads other groups' channels (a Concat) is seen through the group's
        columns only; the other columns' contribution, with their current weights, leaves the target."""
        nodes_p = {n.name: n for n in self.graph.nodes}
        nodes_o = {n.name: n for n in self.original.nodes}
        out = []
        n = len(next(iter(prefix.values())))
        # Chunks alternate between the two folds of the refit's cross-validation; an even size keeps
        # an image and its mirror (adjacent with --flip) in the same fold.
        bs = max(2, min(self.options.batch_size, n // 2) // 2 * 2)
        for use in group.consumers if uses is None else uses:
            node_p, node_o = nodes_p[use.node], nodes_o[use.node]
            full_p, full_o = consumers.matrix(node_p), consumers.matrix(node_o)
            view = consumers.group_view(self.graph, node_p, group, use)
            current = view.linear(full_p)
            original = consumers.group_view(self.original, node_o, group, use).linear(full_o)
            w_o = torch.from_numpy(full_o.weight.astype(np.float32))
            b_o = torch.from_numpy(full_o.bias.astype(np.float32))
            w_rest = torch.from_numpy(full_p.weight[:, view.rest].astype(np.float32))
            partner = _residual_partner(node_o)
            if partner is not None and partner not in prefix:
                partner = None
            folds = tuple(ConsumerStats(*current.weight.shape[::-1]) for _ in range(2))
            x_p, x_o = prefix[use.tensor], reference[use.tensor]
            stride = 1
            for s in range(0, len(x_p), bs):
                x = consumers.unfold(node_p, torch.from_numpy(x_p[s : s + bs]))
                if s == 0:
                    stride = _stride(current.weight.shape[1], x.shape[2] * len(x_p), STATS_GRAM_MACS)
                first = -s * x.shape[2] % stride
                x = _thin(x, stride, first)
                t = torch.matmul(w_o, _thin(consumers.unfold(node_o, torch.from_numpy(x_o[s : s + bs])), stride, first))
                t += b_o[:, None]
                if view.rest.size:
                    t -= torch.matmul(w_rest, x[:, torch.from_numpy(view.rest)])
                x = view.take(x)
                if partner is not None:
                    shift = reference[partner][s : s + bs] - prefix[partner][s : s + bs]
                    t += _thin(consumers.columns(node_o, torch.from_numpy(shift)), stride, first)
                folds[(s // bs) % 2].update(x, t)
            stats = ConsumerStats(*current.weight.shape[::-1])
            for fold in folds:
                stats.merge(fold)
            out.append(_ConsumerData(use, folds, stats, current, original))
        return out

    def choose(self, group: Group, data: list[_ConsumerData], width: int) -> tuple[np.ndarray, np.ndarray, float | None]:
        """Kept channels (sorted), their fold factors, and the greedy's relative loss."""
        n = group.channels
        method = self.options.method
        if method == "random":
            return np.sort(self.rng.choice(n, width, replace=False)), np.ones(width), None
        if method == "global":
            return self._choose_global(group, width)
        if method == "l1":
            norms = np.zeros(n)
            nodes = {node.name: node for node in self.graph.nodes}
            tensors = self.graph.tensors()
            for site in group.slices:
                if site.node in group.producers and site.input_index == 1:
                    w = np.abs(np.asarray(nodes[site.node].inputs[1].values, dtype=np.float64))
                    w = np.take(w, group.entries(tensors, site.tensor, site.offset, site.repeat), axis=site.axis)
                    norms += np.moveaxis(w, site.axis, 0).reshape(n, -1).sum(axis=1)
            return np.sort(np.argsort(-norms, kind="stable")[:width]), np.ones(width), None
        if method == "omp":
            path = group_omp(*_centred(d.stats for d in data), [_k(d) for d in data], width, ridge=OMP_RIDGE)
            keep = path.support(width)
            return keep, np.ones(width), float(path.curve[width] / max(path.curve[0], np.finfo(float).tiny))
        G, c, tau = self.quadratic(group, data)
        path = greedy_local(G, c, tau, max_steps=3 * width)
        keep = path.support(width)
        a = path.weights(width)
        rel = float(path.curve[width] / tau) if tau > 0 and np.isfinite(path.curve[width]) else None
        return keep, n * a[keep], rel

    def _choose_global(self, group: Group, width: int) -> tuple[np.ndarray, np.ndarray, None]:
        """The paper's greedy global imitation on the network's final output (KL for classifiers,
        MSE otherwise), with the Taylor shortlist past 25 neurons; slow without a GPU."""
        if group.partial:
            raise AnalysisError(f"--method global cannot prune {group.name}: its channels share a tensor with "
                                "others (Concat/Split); use --method omp")
        if self.reference is None:
            outputs = [t.name for t in self.original.outputs]
            self.reference, _ = run_segment(self.original, dict(self.inputs), outputs,
                                            provider=self.options.provider, batch_size=self.options.batch_size)
        objective = DownstreamObjective(
            gs.export_onnx(self.graph), self.values_p,
            [(use.tensor, group.tensors[use.tensor][0]) for use in group.consumers], self.reference,
            batch_size=self.options.batch_size, seed=self.options.seed, n_channels=group.channels,
        )
        path = greedy_global(objective.losses, objective.grad, group.channels, width)
        keep = path.support(width)
        return keep, group.channels * path.weights(width)[keep], None

    def apply(
        self, group: Group, data: list[_ConsumerData], keep: np.ndarray, fold: np.ndarray
    ) -> tuple[float, float, list[float]]:
        """Slice the group, then fold/rescale/refit its consumers. Returns (error_fold, error, ridges)."""
        self.graph = slice_channels(self.graph, group, keep)
        energy = sum(centred_energy(d.stats) for d in data) or 1.0
        fold_err = sum(_fold_loss(d, keep, fold) for d in data) / energy
        mode = self.options.reconstruct
        if mode == "full":
            ridges, err = self.refit(group, data, keep, [d.current.weight[:, expand(keep, _k(d))] for d in data])
            return fold_err, err / energy, ridges
        if mode == "scale":
            G = sum(neuron_gram(d.stats.xx, d.current.weight, _k(d)) for d in data)[np.ix_(keep, keep)]
            c = sum(neuron_cross(d.stats.xt, d.stats.sx, d.current.weight, _k(d), d.original.bias) for d in data)[keep]
            fold = refit_scale(G, c, ridge=self.options.ridge)
        self.graph = scale_columns(self.graph, group, fold)
        return fold_err, sum(_fold_loss(d, keep, fold) for d in data) / energy, []

    def refit(self, group: Group, data: list[_ConsumerData], cols: np.ndarray, priors: list[np.ndarray]
              ) -> tuple[list[float], float]:
        """Least-squares refit of each consumer from its statistics' channels ``cols`` towards ``priors``
        (ridge by cross-validation), written into the graph. Returns the ridges and the summed output error."""
        ridges = []
        for d, prior in zip(data, priors):
            w, b, ridge = refit_cv(d.folds, expand(cols, _k(d)), prior=prior)
            ridges.append(ridge)
            self.graph = refit_consumer(self.graph, d.use.node, consumers.Linear(w, b, _k(d)), group, d.use)
        err = sum(quadratic_loss_full(d.stats, expand(cols, _k(d)), *_refit_of(self.graph, group, d)) for d in data)
        return ridges, err

    def refit_after_gate(self, group: Group, data: list[_ConsumerData], keep: np.ndarray, gate: int
                         ) -> tuple[float, list[float]] | None:
        """Refit once more the consumers that run after a gate producer (position ``gate``), on their inputs
        as pruned: refitting the gate's own consumer changed the gate they read. Returns (error, ridges)."""
        stale = [d for d in data if self.live.position[d.use.node] > gate]
        if not stale:
            return None
        need = {d.use.tensor for d in stale}
        fresh = self.collect(group, self.peek(self.graph, self.values_p, need),
                             self.peek(self.original, self.values_o, need), [d.use for d in stale])
        ridges, err = self.refit(group, fresh, np.arange(len(keep)),
                                 [d.current.weight[:, expand(keep, _k(d))] for d in stale])
        rest = [d for d in data if d not in stale]
        err += sum(quadratic_loss_full(d.stats, expand(keep, _k(d)), *_refit_of(self.graph, group, d)) for d in rest)
        return err / (sum(centred_energy(d.stats) for d in [*fresh, *rest]) or 1.0), ridges

    def slice_cache(self, group: Group, keep: np.ndarray) -> None:
        """Slice the group's cached tensors like ``apply`` sliced the graph."""
        sizes = {name: self.values_p[name].shape[axis] for name, (axis, _) in group.tensors.items() if name in self.values_p}
        for name, index in kept_entries(self.graph, group, keep, sizes).items():
            axis = group.tensors[name][0]
            self.values_p[name] = np.ascontiguousarray(np.take(self.values_p[name], index, axis=axis))

    def export(self) -> onnx.ModelProto:
        model = gs.export_onnx(self.graph.cleanup().toposort())
        model.ir_version = self.model.ir_version
        model.producer_name = "onnxprune"
        return infer_shapes(model)


def _stride(d: int, positions: int, budget: int) -> int:
    """Every how many positions a Gram matrix of ``d`` columns keeps to cost at most ``budget`` multiply-adds."""
    return max(1, -(-d * d * positions // budget))


def _thin(a: torch.Tensor, stride: int, first: int) -> torch.Tensor:
    """Every ``stride``-th position of a chunk (B, C, L), counted over its flattened positions from
    ``first`` so that the pattern runs on across samples and chunks: (1, C, M), or ``a`` itself."""
    if stride == 1:
        return a
    return a.transpose(0, 1).reshape(a.shape[1], -1)[:, first::stride].unsqueeze(0)


def _local_curve(pairs: list[tuple[ConsumerStats, np.ndarray, int]], n: int) -> np.ndarray:
    """Relative local-imitation loss by width; on the unpruned network both targets are the layer's
    own output, so the Gram matrix alone defines it."""
    G = sum(neuron_gram(stats.xx, w, k) for stats, w, k in pairs)
    tau = float(G.sum()) / n**2
    path = greedy_local(G, G.sum(axis=1) / n, tau)
    curve = np.minimum.accumulate(np.where(np.isfinite(path.curve), path.curve, np.inf)[1:])
    return np.concatenate([[np.inf], curve / max(tau, np.finfo(float).tiny)])


def _centred(stats) -> tuple[list[np.ndarray], list[np.ndarray], list[float]]:
    A, B, e = zip(*(centred(s.xx, s.xt, s.sx, s.st, s.tt, s.count) for s in stats))
    return list(A), list(B), list(e)


def _k(d: _ConsumerData) -> int:
    """Weight columns per channel: kernel taps × entries per channel after a Flatten × ranges in a Concat."""
    return d.current.k


def _fold_loss(d: _ConsumerData, keep: np.ndarray, fold: np.ndarray) -> float:
    """Output error of the consumer with its kept columns scaled by ``fold`` and its bias unchanged."""
    k = _k(d)
    w = d.current.weight[:, expand(keep, k)] * np.repeat(fold, k)[None, :]
    return quadratic_loss_full(d.stats, expand(keep, k), w, d.current.bias)


def _refit_of(graph: gs.Graph, group: Group, d: _ConsumerData) -> tuple[np.ndarray, np.ndarray]:
    node = next(n for n in graph.nodes if n.name == d.use.node)
    lin = consumers.group_view(graph, node, group, d.use).linear(consumers.matrix(node))
    return lin.weight, lin.bias


def compress(
    model: onnx.ModelProto,
    calib: CalibrationSet,
    options: CompressOptions,
    on_layer: Callable[[int, int, str], None] | None = None,
) -> tuple[onnx.ModelProto, CompressReport]:
    """Prune ``model`` to the options' MAC or latency budget. ``on_layer(i, total, label)`` reports progress."""
    start = time.perf_counter()
    torch.manual_seed(options.seed)
    run = Compressor(model, calib, options)
    analysis = run.analysis
    _check_batch(run.fixed_batch, options)
    order, skipped = schedule(analysis, run.live)
    groups = [g for _, g in order]
    latency = options.target_latency_ms is not None or options.target_latency_ratio is not None
    table_seconds = 0.0
    if latency:
        t0 = time.perf_counter()
        cost = _cost_table(run, groups, options, on_layer)
        table_seconds = 0.0 if options.cost_table else time.perf_counter() - t0
        target = (options.target_latency_ms if options.target_latency_ms is not None
                  else options.target_latency_ratio * cost.model_ms)
    else:
        cost = analysis.macs
        target = options.target_macs if options.target_macs is not None else options.target_ratio * analysis.macs.total
    requested = None
    if options.best_effort:
        lowest = lowest_macs(cost, groups, options.min_channels, options.round_to, options.allocation)
        if target < lowest:
            requested, target = target, lowest
    if options.allocation == "uniform":
        widths = uniform_widths(cost, groups, target, options.min_channels, options.round_to)
    else:
        allocate = epsilon_widths if options.allocation == "epsilon" else curve_widths
        widths = allocate(cost, groups, run.error_curves(order, on_layer), target, options.min_channels,
                          options.round_to)
    if latency:
        target_ms, requested_ms = target, requested
        target, requested = analysis.macs.macs(widths), None
    report = CompressReport(
        macs_before=analysis.macs.total, macs_after=0, params_before=analysis.params, params_after=0,
        target_macs=target, options=asdict(options), provider="", calibration_samples=len(next(iter(run.values_p.values()))),
        skipped=skipped, requested_macs=requested, fixed_batch=run.fixed_batch and asdict(run.fixed_batch),
    )
    for i, (cut, group) in enumerate(order):
        if on_layer is not None:
            on_layer(i, len(order), f"pruning {group.name}")
        t0 = time.perf_counter()
        run.advance(run.graph, run.values_p, cut)
        run.advance(run.original, run.values_o, cut)
        width = widths[group.id]
        if width == group.channels:
            continue
        need = {c.tensor for c in group.consumers}
        data = run.collect(group, run.peek(run.graph, run.values_p, need), run.peek(run.original, run.values_o, need))
        keep, fold, rel = run.choose(group, data, width)
        err_fold, err, ridges = run.apply(group, data, keep, fold)
        run.slice_cache(group, keep)
        gates = [run.live.position[p] for p in group.producers if run.live.position[p] >= cut]
        again = run.refit_after_gate(group, data, keep, min(gates)) if gates and options.reconstruct == "full" else None
        if again is not None:
            err, ridges = again[0], [*ridges[: len(ridges) - len(again[1])], *again[1]]
        report.layers.append(LayerReport(group.name, group.channels, len(keep), [c.node for c in group.consumers],
                                         rel, err_fold, err, ridges, time.perf_counter() - t0,
                                         group_step(group.channels, options.round_to)))
    if on_layer is not None:
        on_layer(len(order), len(order), "")
    pruned = run.export()
    after = analyze(pruned)
    report.macs_after = after.macs.total
    report.params_after = count_params(after.graph)
    report.provider = run.provider
    if latency:
        if on_layer is not None:
            on_layer(len(order), len(order), "timing the pruned model against the original")
        (original_ms, measured_ms), ran = median_latencies(
            [model, pruned], provider=options.provider, batch=cost.batch, threads=cost.threads)
        # A ratio target is judged against the original timed in the same rounds, not the table's older figure.
        bound = target_ms if options.target_latency_ms is not None else target_ms / cost.model_ms * original_ms
        report.latency = LatencyReport(target_ms, options.target_latency_ratio, cost(widths), measured_ms, original_ms, measured_ms <= bound, ran,
                                       cost.batch, cost.threads, requested_ms, cost.to_dict(), table_seconds,
                                       cost.other_machine() if options.cost_table else None)
    report.seconds = time.perf_counter() - start
    return pruned, report


def _check_batch(fixed: FixedBatch | None, options: CompressOptions) -> None:
    """What a graph that fixes its batch cannot do: global imitation (it stacks candidates along the
    batch) and a latency budget at another batch."""
    if fixed is None:
        return
    if options.method == "global":
        raise AnalysisError(f"--method global evaluates many candidates in one batch, but this graph fixes its batch "
                            f"({fixed.reason}): use --method omp, or re-export the model with a dynamic batch")
    latency = options.target_latency_ms is not None or options.target_latency_ratio is not None
    if latency and options.latency_batch != fixed.size:
        raise TargetError(f"--latency-batch {options.latency_batch}: this graph runs only at batch {fixed.size} "
                          f"({fixed.reason}): use --latency-batch {fixed.size}")


def _cost_table(run: Compressor, groups: list[Group], options: CompressOptions,
                on_layer: Callable[[int, int, str], None] | None) -> CostTable:
    """The latency cost table: read from ``options.cost_table``, or measured (and saved when asked)."""
    if options.cost_table:
        table = CostTable.load(options.cost_table, groups)
        table.refuse_another_setup(options.cost_table, run.model, first_provider(options.provider),
                                   options.latency_batch, options.threads)
        return table
    table = measure_cost_table(run.model, run.original, groups, provider=options.provider,
                               batch=options.latency_batch, threads=options.threads,
                               floor=options.min_channels, round_to=options.round_to, on_group=on_layer)
    if options.save_cost_table:
        table.save(options.save_cost_table)
    return table


__all__ = ["ALLOCATIONS", "METHODS", "RECONSTRUCTIONS", "TARGETS", "CompressOptions", "CompressReport", "LatencyReport",
           "compress"]
