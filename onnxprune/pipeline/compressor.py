"""The pruning loop's state: both graphs and their cached live tensors while groups are pruned one by one.

``Compressor`` implements ``onnxprune.core.context.Context``, what the strategies read and do of a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.budget.allocation import group_step
from onnxprune.analysis import analyze
from onnxprune.analysis.groups import ConsumerUse, Group, is_gate, kept_entries
from onnxprune.calib.sources import CalibrationSet
from onnxprune.core import reconstruct
from onnxprune.core.context import ConsumerData
from onnxprune.core.statistics import collect
from onnxprune.errors import CalibrationError
from onnxprune.imitation.refit import centred_energy
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.ir.graph import export_model, loaded, restore_subgraphs, with_metadata
from onnxprune.ir.kept import narrow, read_kept, write_kept
from onnxprune.ir.ort import CPU, first_provider, light_export
from onnxprune.ir.batch import free_batch, restore_batch
from onnxprune.ir.probe import fixed_batch, static_batch
from onnxprune.ir.shapes import infer_shapes
from onnxprune.passes import remove_block, slice_channels
from onnxprune.pipeline.memory import RUN_BYTES, plan
from onnxprune.pipeline.report import LayerReport
from onnxprune.ir.cache import Cache
from onnxprune.ir.cuts import Liveness, cached_axis, no_batch_axis
from onnxprune.ir.store import Store
from onnxprune.strategies import CompressOptions
from onnxprune.strategies.objects import ObjectSamples, object_samples, object_weights, scan


@dataclass
class Pending:
    """A residual stream's consumer to refit when the loop reaches it, and the stream's layer report."""

    position: int
    group: Group
    use: ConsumerUse
    layer: LayerReport
    tally: list[float]  # summed output error and energy of the stream's consumers refitted so far


class Compressor:
    """Holds both graphs and their cached live tensors while pruning group by group."""

    def __init__(self, model: onnx.ModelProto, calib: CalibrationSet, options: CompressOptions) -> None:
        if len(calib) == 0:
            raise CalibrationError("the calibration set is empty: give a folder or file with samples")
        self.model = model
        self.options = options
        # a graph whose input alone fixes the batch is calibrated through a copy with a free batch
        self.batched = free_batch(model)
        self.written_batch = None if self.batched is None else static_batch(model)
        self.analysis = analyze(self.batched or model)
        self.original = loaded(self.analysis.graph).copy()
        self.graph = self.analysis.graph
        self.live = Liveness(self.graph)
        nodes = {n.name: n for n in self.graph.nodes}
        for group in self.analysis.groups:  # a gate's input stays cached up to its group's cut (gate_shifts)
            last = max((self.live.position[c.node] for c in group.consumers), default=-1)
            for name in (g for g in group.gates if g in nodes):
                x = nodes[name].inputs[0].name
                self.live.last_use[x] = max(self.live.last_use.get(x, -1), last)
        self.generators: dict[int, np.random.Generator] = {}  # of the selectors that draw, by seed
        self.memory = plan(self.analysis, self.live, len(calib), options.batch_size, False, options.memory,
                           per_run=RUN_BYTES if first_provider(options.provider) == CPU else None)
        for group in self.analysis.groups:
            if group.name in self.memory.excluded:
                group.blockers.append(f"memory: {self.memory.excluded[group.name]}")
        self.store = Store(self.memory.budget, options.spill_dir)
        self.store.check_room(len(calib), self.memory.cache)
        self.inputs = self.store.stack(calib.batches(options.batch_size), len(calib))
        if len(next(iter(self.inputs.values()))) < 2:
            raise CalibrationError("compress needs at least 2 calibration samples (the refit cross-validates)")
        self.values_p = dict(self.inputs)
        self.values_o = dict(self.inputs)
        light, weights = light_export(self.original.copy())  # the weights handed over as the arrays they are
        self.fixed_batch = fixed_batch(light, self.inputs, weights)
        # A graph that writes its batch into the graph runs as exported; the statistics still batch freely.
        self.run_batch = self.memory.run_batch if self.fixed_batch is None else self.fixed_batch.size
        self.cache = Cache(self.live, self.store, options.provider, self.run_batch, self.fixed_batch is not None)
        self.stats_bytes = self.memory.stats_bytes  # a statistics chunk's unfolded inputs and targets, at most
        self.reference: dict[str, np.ndarray] | None = None  # original outputs, for global imitation
        self.allocation: dict | None = None  # what the allocator measured (the output allocation's probes)
        self.on_status: Callable[[str], None] | None = None  # what the current group's pruning is doing
        self.kept_rows: dict[str, np.ndarray] = {}  # stream producer -> its original output rows still there
        self.pending: list[Pending] = []  # stream consumers to refit when the loop reaches them
        self.select = options.select  # the selector of this run (``Selector.bind``)
        self.notes: dict[str, dict] = {}  # group name -> what the selector noted of it
        self.objects: ObjectSamples | None = None  # a detector's calibration samples with objects, those kept
        self.found: np.ndarray | None = None  # per calibration sample: whether the original finds an object there
        self.weights: np.ndarray | None = None  # a detector's position weights per calibration sample
        self.kept = read_kept(model)  # tensor -> (axis, the original channels it holds): the output's metadata

    def keep_objects(self, on_scan: Callable[[int, int], None] | None = None) -> None:
        """A detector fits and probes on the calibration samples where the original finds an object, with others
        evenly spaced up to ``strategies.objects.LEAST`` (on every sample with ``options.empty_samples``, or where
        there are no more), each position of each layer weighted by where the original sees objects
        (``object_weights``); ``on_scan(done, n)`` as the original looks through the n samples, ``done`` of them so
        far (a detector's only)."""
        scanned = scan(self, on_scan)
        if scanned is None:
            return
        kept = None if self.options.empty_samples else object_samples(scanned.found)
        keep = np.arange(len(scanned.found)) if kept is None else kept[0]
        if kept is not None:
            self.objects = kept[1]
            if len(keep) < self.objects.samples:
                self.inputs = {name: self.store.copy(array, keep) for name, array in self.inputs.items()}
                self.values_p, self.values_o = dict(self.inputs), dict(self.inputs)
        self.found = scanned.found[keep]
        self.weights = object_weights(None if scanned.maps is None else scanned.maps[keep])

    def advance(self, graph: gs.Graph, values: dict[str, np.ndarray], cut: int) -> None:
        """Bring the cached tensors of ``graph`` to those live at ``cut`` (in place)."""
        self.cache.advance(graph, values, cut)

    def exclude_batchless(self, order: list[tuple[int, Group]]) -> None:
        """Before any work: leave unpruned each group that would cache, at its cut or as its consumers' input, a
        tensor without the samples on its first axis (computed from the batch size: a transformer's tokens
        flattened to [B·T, C]), with that tensor as the reason, found on one batch of the first samples."""
        needed = {group.id: self.live.live(cut) | {use.tensor for use in group.consumers} for cut, group in order}
        bad = self.cache.batchless(self.original, self.inputs, set().union(*needed.values())) if needed else {}
        for _, group in order:
            found = sorted(needed[group.id] & set(bad))
            if found:
                group.blockers.append(f"{no_batch_axis(found[0], bad[found[0]], self.cache.probe_batch)} and would "
                                      "be cached at this group's cut")

    def peek(self, graph: gs.Graph, values: dict[str, np.ndarray], names: set[str]) -> dict[str, np.ndarray]:
        """``values`` plus the tensors ``names`` not cached yet, computed ahead (not kept in the cache)."""
        return self.cache.peek(graph, values, names)

    def collect(self, group: Group, prefix: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                uses: list[ConsumerUse] | None = None, samples: np.ndarray | None = None) -> list[ConsumerData]:
        """Streamed statistics of the group's consumers (or ``uses``): inputs on ``prefix`` (the pruned network's
        cached tensors) vs outputs of the original network (its cached tensors ``reference``); ``samples``: the
        calibration samples they hold (None: all), whose position weights apply."""
        weights = self.weights if self.weights is None or samples is None else self.weights[samples]
        return collect(self.graph, self.original, group, prefix, reference, self.options.batch_size, self.kept_rows,
                       uses, self.stats_bytes, weights)

    def statistics(self, group: Group, uses: list[ConsumerUse] | None = None) -> list[ConsumerData]:
        """``collect`` on both networks' tensors as they stand (the consumers' inputs computed ahead where the
        cache does not hold them yet)."""
        need = {use.tensor for use in (group.consumers if uses is None else uses)}
        return self.collect(group, self.cache.peek(self.graph, self.values_p, need),
                            self.cache.peek(self.original, self.values_o, need), uses)

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
            self.reference = self.cache.run(self.original, dict(self.inputs), [t.name for t in self.original.outputs],
                                            progress=False)
        return self.reference

    def prune(self, cut: int, group: Group, width: int) -> LayerReport | None:
        """Refit the residual streams' consumers due before ``cut`` (``refit_pending``), bring both networks to
        ``cut``, then select ``width`` channels of ``group`` and reconstruct its consumers (None: the group keeps all
        its channels; width 0 removes a removable block). A residual stream's consumers that run later are refitted
        when the loop reaches them."""
        self.refit_pending(cut + 1)
        t0 = time.perf_counter()
        self.cache.advance(self.graph, self.values_p, cut)
        self.cache.advance(self.original, self.values_o, cut)
        if width == group.channels:
            return None
        data = self.statistics(group)
        if width == 0:
            return self.remove(group, data, t0)
        keep, fold, rel = self.select.select(self, group, data, width)
        entries = kept_entries(self.graph, group, keep)  # the indices each member tensor keeps, before the slicing
        nodes = {n.name: n for n in self.graph.nodes}
        later = [p for p in group.producers if self.live.position[p] >= cut]
        stream = bool(later) and not is_gate(nodes[later[0]])
        deferred = [d for d in data if self.live.position[d.use.node] > cut] if (
            stream and self.options.reconstruct.refits_after_gate) else []
        if stream:
            self.kept_rows.update({p: entries[nodes[p].outputs[0].name] for p in later})
        now = [d for d in data if d not in deferred]
        err_fold, err, ridges = self.apply(group, now, keep, fold, entries)
        again = (self.refit_after_gate(group, data, keep, min(self.live.position[p] for p in later))
                 if later and not stream and self.options.reconstruct.refits_after_gate else None)
        if again is not None:
            err, ridges = again[0], [*ridges[: len(ridges) - len(again[1])], *again[1]]
        layer = LayerReport(group.name, group.channels, len(keep), [c.node for c in group.consumers], rel, err_fold,
                            err, ridges, time.perf_counter() - t0,
                            group_step(group.channels, self.options.round_to, group.unit),
                            self.notes.pop(group.name, None), group.unit, group.units)
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
                           group_step(group.channels, self.options.round_to, group.unit), unit=group.unit,
                           units=group.units)

    def refit_pending(self, upto: int) -> None:
        """Refit the residual streams' later consumers that run before position ``upto``, on their inputs as
        pruned so far (their columns were sliced at the stream's cut)."""
        due = sorted((p for p in self.pending if p.position < upto), key=lambda p: p.position)
        for p in due:
            t0 = time.perf_counter()
            self.pending.remove(p)
            self.cache.advance(self.graph, self.values_p, p.position)
            self.cache.advance(self.original, self.values_o, p.position)
            fresh = self.statistics(p.group, [p.use])
            self.graph, ridges, err = reconstruct.refit(self.graph, p.group, fresh, np.arange(p.layer.kept),
                                                        [d.current.weight for d in fresh])
            p.tally[0] += err
            p.tally[1] += sum(centred_energy(d.stats) for d in fresh)
            p.layer.error = p.tally[0] / (p.tally[1] or 1.0)
            p.layer.ridges += ridges
            p.layer.seconds += time.perf_counter() - t0

    def apply(self, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray,
              entries: dict[str, np.ndarray]) -> tuple[float, float, list[float]]:
        """Slice the group in the graph and the cache (``entries``: ``kept_entries`` of ``keep``), let the
        reconstruction set its consumers, and the group's gates keep their mean (``reconstruct.gate_shifts``).
        Returns (error_fold, error, ridges)."""
        nodes = {n.name: n for n in self.graph.nodes}
        gates = {nodes[g].inputs[0].name for g in group.gates if g in nodes}
        shifts = reconstruct.gate_shifts(self.graph, group, entries, self.cache.peek(self.graph, self.values_p, gates)
                                         ) if gates else {}
        narrow(self.kept, entries, {n: a for n, (a, _) in group.tensors.items()})
        self.graph = slice_channels(self.graph, group, keep)
        tensors = self.graph.tensors()  # the cached tensors sliced as the graph was
        axes = {name: cached_axis(self.values_p[name], tensors[name], axis) for name, (axis, _) in group.tensors.items()
                if name in self.values_p}
        sizes = {name: self.values_p[name].shape[axis] for name, axis in axes.items()}
        for name, index in kept_entries(self.graph, group, keep, sizes).items():
            self.values_p[name] = self.store.take(self.values_p[name], index, axis=axes[name])
        energy = sum(centred_energy(d.stats) for d in data) or 1.0
        fold_err = sum(reconstruct.fold_loss(d, keep, fold) for d in data) / energy
        err, ridges = self.options.reconstruct.apply(self, group, data, keep, fold)
        reconstruct.shift_gates(self.graph, shifts)
        return fold_err, err / energy, ridges

    def refit_after_gate(self, group: Group, data: list[ConsumerData], keep: np.ndarray, gate: int
                         ) -> tuple[float, list[float]] | None:
        """Refit once more the consumers that run after a gate producer (position ``gate``), on their inputs
        as pruned: refitting the gate's own consumer changed the gate they read. Returns (error, ridges)."""
        stale = [d for d in data if self.live.position[d.use.node] > gate]
        if not stale:
            return None
        fresh = self.statistics(group, [d.use for d in stale])
        self.graph, ridges, err = reconstruct.refit(self.graph, group, fresh, np.arange(len(keep)),
                                                    [d.current.weight[:, expand(keep, d.current.k)] for d in stale])
        rest = [d for d in data if d not in stale]
        err += reconstruct.written_error(self.graph, group, rest, keep)
        return err / (sum(centred_energy(d.stats) for d in [*fresh, *rest]) or 1.0), ridges

    def export(self) -> onnx.ModelProto:
        model = export_model(self.graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False))
        if self.batched is not None:
            model = restore_batch(model, self.model)
        model.ir_version = self.model.ir_version
        model.producer_name = "onnxprune"
        return write_kept(with_metadata(restore_subgraphs(infer_shapes(model), self.model), self.model), self.kept)

