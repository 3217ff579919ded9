"""``compress``: layer-wise channel pruning of an ONNX model on calibration data.

Groups are pruned in graph order. At each group's cut (just before its first consumer) the
calibration set has been pushed through the already-pruned prefix and, in lockstep, through the
original network. The consumers' unfolded inputs (pruned prefix) and outputs (original network)
are reduced to streamed statistics, from which the selector chooses the channels and the
reconstruction the consumer weights. The budget, the allocator, the selector and the reconstruction are
the strategy objects of ``CompressOptions`` (``onnxprune.strategies``): the loop calls them, it never
compares a name.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.allocation import check_target, group_step
from onnxprune.analysis import Analysis, analyze, consumers
from onnxprune.ir.graph import restore_subgraphs, static_shape
from onnxprune.ir.shapes import infer_shapes
from onnxprune.analysis.groups import ConsumerUse, Group, kept_entries
from onnxprune.analysis.macs import count_params
from onnxprune.calib.sources import CalibrationSet
from onnxprune.cost import LatencyReport, Spend
from onnxprune.errors import AnalysisError, CalibrationError, ResourceError, TargetError
from onnxprune.imitation.local import greedy_local
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import centred_energy, quadratic_loss_full, refit_cv
from onnxprune.imitation.stats import ConsumerStats, neuron_gram
from onnxprune.passes import refit_consumer, remove_block, scale_columns, slice_channels
from onnxprune.ir.probe import FixedBatch, fixed_batch, free_batch, restore_batch, static_batch
from onnxprune.runtime.segments import Liveness, run_segment
from onnxprune.runtime.store import Array, Store, default_budget, show_bytes
from onnxprune.strategies import CompressOptions

Progress = Callable[[int, int, str], None]
# Integer/quantized ops that stand where float Conv/MatMul would: a quantized model has no float channels to prune.
QUANTIZED_OPS = frozenset({"ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear",
                           "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLSTM"})
# A consumer's Gram matrix costs D² multiply-adds per position (D = input channels x kernel taps); past
# these budgets its statistics take every k-th position (counted across samples, so all contribute). The error
# curves of the allocation need the shape of each layer's loss, the refit more: MobileNetV2's largest
# consumer costs 8.3e9 on the curves' 128 samples and 3.3e10 on 500 photos, so neither budget touches it;
# a 3x3 conv of YOLOv8n at 320 costs 1.4e11 on 64 photos.
CURVE_GRAM_MACS = 10**10
STATS_GRAM_MACS = 5 * 10**10


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
    selection: dict | None = None  # what the selector noted: global/auto's method, discrepancies, why


@dataclass
class CompressReport:
    macs_before: int
    macs_after: int
    params_before: int
    params_after: int
    target_macs: float  # the MAC budget (a latency budget: the MACs its widths come to)
    options: dict  # CompressOptions.to_dict()
    provider: str
    calibration_samples: int
    seconds: float = 0.0
    layers: list[LayerReport] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    requested_macs: float | None = None  # the budget asked for, when best_effort raised it to the lowest reachable
    latency: LatencyReport | None = None  # with a latency target (target_macs: the MACs its widths come to)
    fixed_batch: dict | None = None  # {"size", "reason"}: the graph fixes its batch, calibration ran at that batch
    written_batch: dict | None = None  # {"size", "reason"}: only the input fixes it; calibration batched, model kept it
    allocation: dict | None = None  # what the allocator measured: the output allocation's probes and their time
    selection: dict | None = None  # what the selector recorded of the run (auto: its global budget and spending)

    def to_dict(self) -> dict:
        return asdict(self)


def schedule(analysis: Analysis, live: Liveness, streams: bool = False) -> tuple[list[tuple[int, Group]], list[dict]]:
    """Prunable groups with their cut (position of the first consumer), and those left alone.

    A group is pruned at its cut. Producers that run after it are either gates (squeeze-excite: one value
    per channel and sample, computed from the group's pooled channels by its first consumer) or, in a
    residual stream (the outputs of several blocks summed by ``Add``s), the later blocks' projections: their
    rows are sliced at the cut, and the consumers that read the stream later are refitted when the loop
    reaches them (``Compressor.refit_pending``); a stream may be a piece of a Split/Concat (YOLO's C2f). A
    group that mixes gates with other later producers is left alone. Consumers that read the channels later
    are fed by running ahead from the cut (``peek``). Residual streams are pruned only with ``streams``.
    """
    order, skipped = [], []
    nodes = {n.name: n for n in analysis.graph.nodes}
    for g in analysis.groups:
        if not g.prunable:
            skipped.append({"group": g.name, "channels": g.channels, "reason": g.reason})
            continue
        cut = min(live.position[c.node] for c in g.consumers)
        later = [p for p in g.producers if live.position[p] >= cut]
        gates = [p for p in later if _is_gate(nodes[p])]
        if gates and len(gates) < len(later):
            skipped.append({"group": g.name, "channels": g.channels,
                            "reason": "coupled across layers through a gate and other later producers: not pruned "
                                      "by this release"})
            continue
        if later and not gates and not streams:
            skipped.append({"group": g.name, "channels": g.channels,
                            "reason": "a residual stream (several blocks' outputs summed by Adds): pruned only "
                                      "with --residual-streams"})
            continue
        order.append((cut, g))
    # An SE reducer's own group is cut at the gate producer, after the gated group sliced that producer's
    # rows: its statistics would no longer match the original's outputs.
    gates = {p: g for cut, g in order for p in g.producers if live.position[p] >= cut and _is_gate(nodes[p])}
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
            quantized = sorted({n.op for n in analysis.graph.nodes if n.op in QUANTIZED_OPS})
            hint = (f"; the model is quantized ({', '.join(quantized)}): prune the float model, then quantize it"
                    if quantized else "")
            raise AnalysisError("no prunable channel group in this graph: no channels run from a Conv, ConvTranspose, "
                                f"Gemm or MatMul to another{hint}")
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
class Pending:
    """A residual stream's consumer to refit when the loop reaches it, and the stream's layer report."""

    position: int
    group: Group
    use: ConsumerUse
    layer: LayerReport
    tally: list[float]  # summed output error and energy of the stream's consumers refitted so far


@dataclass
class ConsumerData:
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
        # a graph whose input alone fixes the batch is calibrated through a copy with a free batch
        self.written_batch = static_batch(model)
        self.batched = free_batch(model) if self.written_batch is not None else None
        if self.batched is None:
            self.written_batch = None
        self.analysis = analyze(self.batched or model)
        self.original = self.analysis.graph.copy()
        self.graph = self.analysis.graph
        self.live = Liveness(self.graph)
        self.generators: dict[int, np.random.Generator] = {}  # of the selectors that draw, by seed
        self.store = Store(default_budget() if options.memory is None else options.memory, options.spill_dir)
        self._check_room(len(calib))
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
        self.allocation: dict | None = None  # what the allocator measured (the output allocation's probes)
        self.on_chunk: Callable[[int, int], None] | None = None  # (samples done, total) as the cache advances
        self.on_status: Callable[[str], None] | None = None  # what the current group's pruning is doing
        self.kept_rows: dict[str, np.ndarray] = {}  # stream producer -> its original output rows still there
        self.pending: list[Pending] = []  # stream consumers to refit when the loop reaches them
        self.select = options.select  # the selector of this run (``Selector.bind``)
        self.notes: dict[str, dict] = {}  # group name -> what the selector noted of it

    def _check_room(self, n: int) -> None:
        """ResourceError before any work when ``n`` samples' cached tensors (the inputs, and at the widest cut,
        i.e. before any group's consumer, the live tensors of both networks) cannot fit in the RAM budget plus the
        free space of the spill folder."""
        def size(names: set[str]) -> int:
            return sum(_sample_bytes(tensors[name]) for name in names if name in tensors)

        tensors = self.graph.tensors()
        inputs = {t.name for t in self.graph.inputs}
        cuts = {self.live.position[use.node] for group in self.analysis.groups for use in group.consumers}
        widest = max((size(self.live.live(cut) - inputs) for cut in cuts), default=0)
        need = n * (size(inputs) + 2 * widest)
        if need > self.store.budget and not self.store.folder.is_dir():
            raise ResourceError(f"the spill folder {self.store.folder} is not a folder: create it or point spill_dir "
                                "at another", option="spill_dir")
        free = shutil.disk_usage(self.store.folder).free if need > self.store.budget else 0
        if need > self.store.budget + free:
            raise ResourceError(
                f"{n} calibration samples need about {show_bytes(need)} of cached activations, and there are "
                f"{show_bytes(self.store.budget)} of RAM for them (the memory budget) and {show_bytes(free)} free "
                f"in {self.store.folder}: calibrate on fewer samples, raise the memory budget, free disk space "
                "there or point spill_dir elsewhere", option="spill_dir")

    def _load(self, calib: CalibrationSet) -> dict[str, Array]:
        """The calibration inputs, batch by batch into the store's arrays."""
        if len(calib) == 0:
            raise CalibrationError("the calibration set is empty: give a folder or file with samples")
        return self.store.stack(calib.batches(self.options.batch_size), len(calib))

    def advance(self, graph: gs.Graph, values: dict[str, np.ndarray], cut: int) -> None:
        """Bring the cached tensors of ``graph`` to those live at ``cut`` (in place)."""
        live = self.live.live(cut)
        tensors = graph.tensors()  # a removed block's tensors are gone from the pruned graph
        new, ran = run_segment(graph, values, {t for t in live - set(values) if t in tensors},
                               provider=self.options.provider, batch_size=self.run_batch,
                               exact=self.fixed_batch is not None, store=self.store, on_chunk=self.on_chunk)
        self.provider = ran or self.provider
        values.update(new)
        for name in set(values) - live:
            del values[name]

    def error_curves(
        self, order: list[tuple[int, Group]], on_layer: Progress | None = None
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
                               batch_size=self.run_batch, exact=self.fixed_batch is not None, store=self.store,
                               on_chunk=self.on_chunk)
        self.provider = ran or self.provider
        return {**values, **new}

    def collect(self, group: Group, prefix: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                uses: list[ConsumerUse] | None = None) -> list[ConsumerData]:
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
            rows = self.kept_rows.get(use.node)  # a stream producer whose outputs were sliced already
            if rows is not None:
                full_o = consumers.Linear(full_o.weight[rows], full_o.bias[rows], full_o.k)
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
                    ref = reference[partner][s : s + bs]
                    shift = (ref if rows is None else np.take(ref, rows, axis=1)) - prefix[partner][s : s + bs]
                    t += _thin(consumers.columns(node_o, torch.from_numpy(shift)), stride, first)
                folds[(s // bs) % 2].update(x, t)
            stats = ConsumerStats(*current.weight.shape[::-1])
            for fold in folds:
                stats.merge(fold)
            out.append(ConsumerData(use, folds, stats, current, original))
        return out

    def note(self, group: Group, info: dict) -> None:
        """What the selector did on ``group``, for its layer report."""
        self.notes[group.name] = info

    def status(self, text: str) -> None:
        """Show what the current group's pruning is doing (a long selection stays visibly alive)."""
        if self.on_status is not None:
            self.on_status(text)

    def generator(self, seed: int) -> np.random.Generator:
        """The generator of ``seed``, drawn on across groups."""
        if seed not in self.generators:
            self.generators[seed] = np.random.default_rng(seed)
        return self.generators[seed]

    def reference_outputs(self) -> dict[str, np.ndarray]:
        """The original network's outputs on the calibration set (computed once)."""
        if self.reference is None:
            outputs = [t.name for t in self.original.outputs]
            self.reference, _ = run_segment(self.original, dict(self.inputs), outputs, provider=self.options.provider,
                                            batch_size=self.run_batch, exact=self.fixed_batch is not None,
                                            store=self.store)
        return self.reference

    def prune(self, cut: int, group: Group, width: int) -> LayerReport | None:
        """Bring both networks to ``cut``, then select ``width`` channels of ``group`` and reconstruct its
        consumers (None: the group keeps all its channels; width 0 removes a removable block). A residual
        stream's consumers that run later are refitted when the loop reaches them (``refit_pending``)."""
        t0 = time.perf_counter()
        self.advance(self.graph, self.values_p, cut)
        self.advance(self.original, self.values_o, cut)
        if width == group.channels:
            return None
        need = {c.tensor for c in group.consumers}
        data = self.collect(group, self.peek(self.graph, self.values_p, need),
                            self.peek(self.original, self.values_o, need))
        if width == 0:
            return self.remove(group, data, t0)
        keep, fold, rel = self.select.select(self, group, data, width)
        nodes = {n.name: n for n in self.graph.nodes}
        later = [p for p in group.producers if self.live.position[p] >= cut]
        stream = bool(later) and not _is_gate(nodes[later[0]])
        deferred = [d for d in data if self.live.position[d.use.node] > cut] if (
            stream and self.options.reconstruct.refits_after_gate) else []
        if stream:
            rows = kept_entries(self.graph, group, keep)
            self.kept_rows.update({p: rows[nodes[p].outputs[0].name] for p in later})
        now = [d for d in data if d not in deferred]
        err_fold, err, ridges = self.apply(group, now, keep, fold)
        self.slice_cache(group, keep)
        again = (self.refit_after_gate(group, data, keep, min(self.live.position[p] for p in later))
                 if later and not stream and self.options.reconstruct.refits_after_gate else None)
        if again is not None:
            err, ridges = again[0], [*ridges[: len(ridges) - len(again[1])], *again[1]]
        layer = LayerReport(group.name, group.channels, len(keep), [c.node for c in group.consumers], rel, err_fold,
                            err, ridges, time.perf_counter() - t0, group_step(group.channels, self.options.round_to),
                            self.notes.pop(group.name, None))
        energy = sum(centred_energy(d.stats) for d in now)
        tally = [err * energy, energy]
        self.pending += [Pending(self.live.position[d.use.node], group, d.use, layer, tally) for d in deferred]
        return layer

    def remove(self, group: Group, data: list[ConsumerData], t0: float) -> LayerReport:
        """Replace the group's residual block by its shortcut plus the mean of its consumer's target (the refit
        with no channel left; its relative error is 1 by definition)."""
        (d,) = data
        self.graph = remove_block(self.graph, self.analysis.blocks[group.id], d.stats.st / max(d.stats.count, 1))
        for name in group.tensors:
            self.values_p.pop(name, None)
        names = {n.name for n in self.graph.nodes}
        self.pending = [p for p in self.pending if p.use.node in names]
        return LayerReport(group.name, group.channels, 0, [d.use.node], None, 1.0, 1.0, [], time.perf_counter() - t0,
                           group_step(group.channels, self.options.round_to))

    def refit_pending(self, upto: int) -> None:
        """Refit the residual streams' later consumers that run before position ``upto``, on their inputs as
        pruned so far (their columns were sliced at the stream's cut)."""
        due = sorted((p for p in self.pending if p.position < upto), key=lambda p: p.position)
        for p in due:
            t0 = time.perf_counter()
            self.pending.remove(p)
            self.advance(self.graph, self.values_p, p.position)
            self.advance(self.original, self.values_o, p.position)
            need = {p.use.tensor}
            fresh = self.collect(p.group, self.peek(self.graph, self.values_p, need),
                                 self.peek(self.original, self.values_o, need), [p.use])
            ridges, err = self.refit(p.group, fresh, np.arange(p.layer.kept), [d.current.weight for d in fresh])
            p.tally[0] += err
            p.tally[1] += sum(centred_energy(d.stats) for d in fresh)
            p.layer.error = p.tally[0] / (p.tally[1] or 1.0)
            p.layer.ridges += ridges
            p.layer.seconds += time.perf_counter() - t0

    def apply(
        self, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
    ) -> tuple[float, float, list[float]]:
        """Slice the group, then let the reconstruction set its consumers. Returns (error_fold, error, ridges)."""
        self.graph = slice_channels(self.graph, group, keep)
        energy = sum(centred_energy(d.stats) for d in data) or 1.0
        fold_err = sum(_fold_loss(d, keep, fold) for d in data) / energy
        err, ridges = self.options.reconstruct.apply(self, group, data, keep, fold)
        return fold_err, err / energy, ridges

    def scale(self, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray) -> float:
        """Scale the kept channels' consumer columns by ``fold``; returns the consumers' summed output error."""
        self.graph = scale_columns(self.graph, group, fold)
        return sum(_fold_loss(d, keep, fold) for d in data)

    def refit(self, group: Group, data: list[ConsumerData], cols: np.ndarray, priors: list[np.ndarray]
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

    def refit_after_gate(self, group: Group, data: list[ConsumerData], keep: np.ndarray, gate: int
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
            self.values_p[name] = self.store.take(self.values_p[name], index, axis=group.tensors[name][0])

    def export(self) -> onnx.ModelProto:
        model = gs.export_onnx(self.graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False))
        if self.batched is not None:
            model = restore_batch(model, self.model)
        model.ir_version = self.model.ir_version
        model.producer_name = "onnxprune"
        return restore_subgraphs(infer_shapes(model), self.model)


def _sample_bytes(tensor: gs.Tensor) -> int:
    """Bytes of one sample of ``tensor`` (0 where its shape past the batch is not static)."""
    shape = static_shape(tensor)
    if not shape or any(d is None for d in shape[1:]):
        return 0
    return int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(tensor.dtype or np.float32).itemsize


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


def _k(d: ConsumerData) -> int:
    """Weight columns per channel: kernel taps × entries per channel after a Flatten × ranges in a Concat."""
    return d.current.k


def _fold_loss(d: ConsumerData, keep: np.ndarray, fold: np.ndarray) -> float:
    """Output error of the consumer with its kept columns scaled by ``fold`` and its bias unchanged."""
    k = _k(d)
    w = d.current.weight[:, expand(keep, k)] * np.repeat(fold, k)[None, :]
    return quadratic_loss_full(d.stats, expand(keep, k), w, d.current.bias)


def _refit_of(graph: gs.Graph, group: Group, d: ConsumerData) -> tuple[np.ndarray, np.ndarray]:
    node = next(n for n in graph.nodes if n.name == d.use.node)
    lin = consumers.group_view(graph, node, group, d.use).linear(consumers.matrix(node))
    return lin.weight, lin.bias


def compress(
    model: onnx.ModelProto,
    calib: CalibrationSet,
    options: CompressOptions,
    on_layer: Progress | None = None,
) -> tuple[onnx.ModelProto, CompressReport]:
    """Prune ``model`` to the options' budget. ``on_layer(i, total, label)`` reports progress."""
    start = time.perf_counter()
    run = Compressor(model, calib, options)
    _check_batch(run.fixed_batch or run.written_batch, options)
    order, skipped = schedule(run.analysis, run.live, options.residual_streams)
    spend = options.budget.resolve(run, [g for _, g in order], on_layer)
    widths, target, requested = _allocate(run, order, spend, on_layer)
    run.select = options.select.bind(run, order, widths)
    target_macs, requested_macs = spend.recorded(widths, target, requested)
    report = CompressReport(
        macs_before=run.analysis.macs.total, macs_after=0, params_before=run.analysis.params, params_after=0,
        target_macs=target_macs, options=options.to_dict(), provider="",
        calibration_samples=len(next(iter(run.values_p.values()))), skipped=skipped, requested_macs=requested_macs,
        fixed_batch=run.fixed_batch and asdict(run.fixed_batch), allocation=run.allocation,
        written_batch=run.written_batch and asdict(run.written_batch),
    )
    for i, (cut, group) in enumerate(order):
        _progress(on_layer, i, len(order), f"pruning {group.name}")
        run.on_chunk = None if on_layer is None else partial(_samples, on_layer, i, len(order), group.name)
        run.on_status = None if on_layer is None else partial(_status, on_layer, i, len(order), group.name)
        run.refit_pending(cut + 1)
        layer = run.prune(cut, group, widths[group.id])
        if layer is not None:
            report.layers.append(layer)
    run.refit_pending(len(run.graph.nodes) + 1)
    _progress(on_layer, len(order), len(order), "")
    pruned = run.export()
    after = analyze(pruned)
    report.macs_after = after.macs.total
    report.params_after = count_params(after.graph)
    report.provider = run.provider
    report.latency = spend.outcome(model, pruned, widths, target, requested,
                                   lambda label: _progress(on_layer, len(order), len(order), label))
    report.selection = run.select.summary()
    report.seconds = time.perf_counter() - start
    return pruned, report


def _allocate(run: Compressor, order: list[tuple[int, Group]], spend: Spend, on_layer: Progress | None
              ) -> tuple[dict[int, int], float, float | None]:
    """The widths the allocator gives within ``spend``, the target they were allocated to, and the budget
    asked for when best_effort raised it to the lowest reachable (else None)."""
    options, groups = run.options, [g for _, g in order]
    target, requested = spend.target, None
    if options.best_effort:
        lowest = options.allocate.lowest(spend.cost, groups, options.min_channels, options.round_to)
        if target < lowest:
            requested, target = target, lowest
    # before the curves, which may take minutes: an unreachable target is the user's to fix at once
    check_target(spend.cost, groups, target, options.min_channels, options.round_to, options.allocate.floor)
    curves, run.allocation = options.allocate.curves(run, order, on_layer)
    widths = options.allocate.widths(spend.cost, groups, curves, target, options.min_channels, options.round_to)
    return widths, target, requested


def _samples(on_layer: Progress, i: int, total: int, name: str, done: int, samples: int) -> None:
    """Progress within a group: how many samples have been pushed to its cut (a long run stays visibly alive)."""
    _status(on_layer, i, total, name, f"{done}/{samples} samples")


def _status(on_layer: Progress, i: int, total: int, name: str, text: str) -> None:
    on_layer(i, total, f"pruning {name}: {text}")


def _progress(on_layer: Progress | None, i: int, total: int, label: str) -> None:
    if on_layer is not None:
        on_layer(i, total, label)


def _check_batch(fixed: FixedBatch | None, options: CompressOptions) -> None:
    """What a graph that fixes its batch cannot do: a latency budget timed at another batch."""
    if fixed is None:
        return
    batch = options.budget.timing_batch()
    if batch is not None and batch != fixed.size:
        raise TargetError(f"latency batch {batch}: this graph runs only at batch {fixed.size} "
                          f"({fixed.reason}): time it at batch {fixed.size}", option="latency_batch")


__all__ = ["CompressOptions", "CompressReport", "LatencyReport", "compress"]
