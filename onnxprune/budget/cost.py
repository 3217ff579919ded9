"""What an allocation spends: MACs (``MacCost``) or the latency predicted by a measured ``CostTable``.

Both are a ``Cost``: the cost of the model for given group widths, and of the unpruned model.

The latency cost table: for every group the subgraph of its producers, channel-wise ops and consumers
is cut out of the model and timed at a few widths (the first ``w`` channels kept), in alternating rounds.
The model of the pruned network's latency is additive in the savings:

    latency(widths) = whole model's measured latency + Σ_g [cost_g(widths[g]) − cost_g(all channels)]

with ``cost_g`` interpolated linearly between the measured widths after an isotonic fit (a cost
never falls when a width grows). Session overhead cancels in the differences. A conv shared by two
groups (consumer of one, producer of the next) has its saving counted in both, so chains of pruned
groups are predicted a little optimistic; the final ``bench`` of the written model is the check.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import export_model
from onnxprune.ir.inputs import resolve_input_shapes
from onnxprune.analysis.groups import Group
from onnxprune.analysis.macs import MacModel
from onnxprune.errors import ModelError
from onnxprune.fileio import atomic_write
from onnxprune.passes import slice_channels
from onnxprune.ir.ort import PROVIDER_CHAINS, make_session, model_input_specs
from onnxprune.runtime.timing import BLOCK_SECONDS, random_inputs, time_rounds


class Cost(Protocol):
    """What the allocation spends (MACs, predicted milliseconds)."""

    @property
    def total(self) -> float:
        """The unpruned model's cost."""

    def __call__(self, widths: dict[int, int]) -> float:
        """The cost when group ``g`` keeps ``widths[g]`` channels (others unchanged)."""

    def show(self, value: float) -> str:
        """``value`` with its unit, for messages."""


@dataclass(frozen=True)
class MacCost:
    """MACs per sample as the cost."""

    model: MacModel

    @property
    def total(self) -> float:
        return self.model.total

    def __call__(self, widths: dict[int, int]) -> float:
        return self.model.macs(widths)

    def show(self, value: float) -> str:
        return f"{value / 1e6:.3g}M MACs"


def as_cost(cost: MacModel | Cost) -> Cost:
    return MacCost(cost) if isinstance(cost, MacModel) else cost


def group_step(channels: int, round_to: int, unit: int = 1) -> int:
    """The width step of a group of ``channels``: ``round_to``, or, for a group narrower than four steps,
    the largest power of two up to a quarter of its channels (and ``round_to``), so that rounding never
    forbids a group to give up a quarter of its channels (a 16-channel group with ``--round-to 8``
    could only halve). A channel of ``unit`` entries (a conv group, ``Group.unit``) counts ``unit`` of
    ``round_to``'s."""
    round_to = max(1, round_to // unit)
    if channels >= 4 * round_to:
        return round_to
    step = 1
    while 2 * step <= min(channels // 4, round_to):
        step *= 2
    return step


TABLE_VERSION = 3  # 2: records the graph's hash, the input dims and the machine; 3: timed as `bench` times (blocks)
FRACTIONS = (0.25, 0.5, 0.75)  # widths timed besides the floor and all channels


def format_ms(value: float) -> str:
    """Milliseconds to 3 significant digits, without an exponent ('0.182 ms', '1039 ms')."""
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def isotonic(values: Sequence[float]) -> np.ndarray:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return np.concatenate([np.full(int(n), m) for m, n in blocks]) if blocks else np.zeros(0)


def graph_sha256(model: onnx.ModelProto) -> str:
    """SHA-256 of the model's graph: its structure, input shapes and weights."""
    return hashlib.sha256(model.graph.SerializeToString(deterministic=True)).hexdigest()


def input_dims(model: onnx.ModelProto) -> dict[str, list]:
    """Each input's dims as the model declares them (a dynamic dim as its symbol)."""
    return {name: dims for name, dims, _ in model_input_specs(model)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def this_machine() -> dict[str, object]:
    """Host name, CPU model and logical core count of the machine running now."""
    return {"host": platform.node(), "cpu": _cpu_model(), "cores": os.cpu_count()}


def _threads(n: int | None) -> str:
    return f"{n} intra-op threads" if n else "onnxruntime's default threads"


def _dims_text(inputs: dict[str, list]) -> str:
    return ", ".join(f"{name}:{'x'.join(str(d) for d in dims)}" for name, dims in inputs.items())


@dataclass
class GroupCost:
    """Measured latency (ms) of one group's subgraph at each of ``widths`` (increasing, last = all channels)."""

    id: int
    name: str
    channels: int
    widths: list[int]
    ms: list[float]

    def at(self, width: float) -> float:
        """Interpolated cost at ``width`` channels, monotone in the width."""
        return float(np.interp(width, self.widths, isotonic(self.ms)))

    def saving(self, width: float) -> float:
        """Milliseconds saved by narrowing the group from all its channels to ``width``."""
        return self.at(self.channels) - self.at(width)


@dataclass
class CostTable:
    """Predicted latency of the model for any group widths (see the module docstring)."""

    model_ms: float  # the whole, unpruned model, measured
    provider: str  # the execution provider that really ran
    batch: int
    threads: int | None
    graph_sha256: str  # of the model timed (see graph_sha256)
    inputs: dict[str, list]  # its input dims (see input_dims)
    groups: list[GroupCost] = field(default_factory=list)
    machine: dict = field(default_factory=this_machine)
    version: int = TABLE_VERSION

    @property
    def total(self) -> float:
        return self.model_ms

    def __call__(self, widths: dict[int, int]) -> float:
        """Predicted latency (ms) when group ``g`` keeps ``widths[g]`` channels (others unchanged)."""
        return self.model_ms - sum(g.saving(widths[g.id]) for g in self.groups if g.id in widths)

    def show(self, value: float) -> str:
        return format_ms(value)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: Path) -> None:
        atomic_write(Path(path), lambda tmp: tmp.write_text(json.dumps(self.to_dict(), indent=1)))

    @classmethod
    def load(cls, path: Path, groups: Sequence[Group]) -> CostTable:
        """A table written by ``save``; it must list exactly ``groups`` (same names and channels)."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            table = cls(**{**data, "groups": [GroupCost(**g) for g in data["groups"]]})
        except FileNotFoundError:
            raise ModelError(f"cost table {path} not found: measure one and save it", option="save_cost_table") from None
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise ModelError(f"{path} is not a cost table written by onnxprune ({e}): measure a new one instead "
                             "of reading this file", option="cost_table") from None
        if table.version != TABLE_VERSION:
            raise ModelError(f"cost table {path} has version {table.version}, this onnxprune reads "
                             f"{TABLE_VERSION}: measure a new one")
        want = {(g.name, g.channels) for g in groups}
        have = {(g.name, g.channels) for g in table.groups}
        if want != have:
            name, channels = sorted(want - have or have - want)[0]
            where = "the model's group" if want - have else "the table's group"
            side = "is not in the table" if want - have else "is not a prunable group of the model"
            raise ModelError(f"cost table {path} does not fit this model ({where} {name} with {channels} channels "
                             f"{side}): measure a new table for this model")
        ids = {g.name: g.id for g in groups}
        for g in table.groups:
            g.id = ids[g.name]
        return table

    def refuse_another_setup(self, path: Path, model: onnx.ModelProto, provider: str, batch: int,
                             threads: int | None) -> None:
        """ModelError naming the first thing the table was measured for that differs from this run: the batch,
        threads, execution provider, input dims or graph (structure and weights) of ``model``."""
        new = "measure a new table instead of reading this one"
        inputs, digest = input_dims(model), graph_sha256(model)
        short = {chain[0]: name for name, chain in PROVIDER_CHAINS.items()}
        for differs, what, option in (
            (self.batch != batch, f"at batch {self.batch}, not {batch}: time at batch {self.batch} or {new}",
             "latency_batch"),
            (self.threads != threads, f"with {_threads(self.threads)}, not {_threads(threads)}: "
                                      f"use {_threads(self.threads)} or {new}", "threads"),
            (self.provider != provider, f"on {self.provider}, not {provider}: use the "
                                        f"{short.get(self.provider, self.provider)} provider or {new}", "provider"),
            (self.inputs != inputs, f"for inputs {_dims_text(self.inputs)}, not this model's {_dims_text(inputs)}: "
                                    f"{new}", "cost_table"),
            (self.graph_sha256 != digest, f"for another model with the same groups (other weights or graph: sha256 "
                                          f"{self.graph_sha256[:12]}, this model's {digest[:12]}): {new}",
             "cost_table"),
        ):
            if differs:
                raise ModelError(f"cost table {path} was measured {what}", option=option)

    def other_machine(self) -> str | None:
        """What differs between the machine that measured the table and this one (None: nothing)."""
        here = this_machine()
        return "; ".join(f"{key} {self.machine.get(key)!r}, here {value!r}"
                         for key, value in here.items() if self.machine.get(key) != value) or None


def widths_to_time(channels: int, floor: int, round_to: int) -> list[int]:
    """The widths timed for a group: its floor, a few fractions (multiples of ``round_to``), all channels."""
    def up(n: float) -> int:
        return min(channels, max(floor, int(-(-n // round_to) * round_to)))

    return sorted({up(floor), *(up(f * channels) for f in FRACTIONS), channels})


def _subgraph(graph: gs.Graph, group: Group) -> gs.Graph:
    """The group's producers, channel-wise ops and consumers as a graph of their own."""
    members = set(group.producers) | {c.node for c in group.consumers}
    sub = graph.copy()
    for node in sub.nodes:
        if any(t.name in group.tensors for t in node.outputs):
            members.add(node.name)
    nodes = [n for n in sub.nodes if n.name in members]
    produced = {t.name for n in nodes for t in n.outputs}
    inputs: dict[str, gs.Variable] = {}
    for n in nodes:
        for t in n.inputs:
            if isinstance(t, gs.Variable) and t.name not in produced and t.name:
                inputs[t.name] = t
    outputs = [t for n in nodes for t in n.outputs
               if t in sub.outputs or any(c.name not in members for c in t.outputs)]
    sub.inputs, sub.outputs = list(inputs.values()), outputs
    return sub.cleanup(recurse_subgraphs=False)


def _timing_model(graph: gs.Graph, opset_model: onnx.ModelProto) -> onnx.ModelProto:
    model = export_model(graph)
    model.ir_version = opset_model.ir_version
    return model


def _feed(model: onnx.ModelProto, batch: int) -> dict[str, np.ndarray]:
    specs = model_input_specs(model)
    return random_inputs(specs, resolve_input_shapes(specs, None, batch, "the timed model"))


def median_latencies(
    models: Sequence[onnx.ModelProto], *, provider: str = "auto", batch: int = 1, threads: int | None = None,
    warmup: int = 3, runs: int = 20,
) -> tuple[list[float], str]:
    """Median milliseconds of each model timed in alternating blocks, as ``onnxprune bench`` times them, and the
    provider that ran."""
    sessions = [make_session(m, provider, threads, spin_between_runs=False) for m in models]
    times = time_rounds([(s, _feed(m, batch)) for (s, _), m in zip(sessions, models)], warmup, runs,
                        block_seconds=BLOCK_SECONDS)
    return [float(np.median(t)) * 1e3 for t in times], sessions[0][1]


def measure_cost_table(
    model: onnx.ModelProto,
    graph: gs.Graph,
    groups: Sequence[Group],
    *,
    provider: str = "auto",
    batch: int = 1,
    threads: int | None = None,
    floor: int = 1,
    round_to: int = 1,
    warmup: int = 3,
    runs: int = 15,
    on_group: Callable[[int, int, str], None] | None = None,
    removable: Collection[int] = (),
) -> CostTable:
    """Time ``model`` whole and each group's subgraph (cut from its analysed ``graph``) at a few widths; a
    group in ``removable`` (a residual block, ``analysis.blocks``) costs nothing at width 0, its whole subgraph
    gone."""
    (model_ms,), active = median_latencies([model], provider=provider, batch=batch, threads=threads,
                                           warmup=warmup, runs=runs)
    table = CostTable(model_ms, active, batch, threads, graph_sha256(model), input_dims(model))
    for i, group in enumerate(groups):
        if on_group is not None:
            on_group(i, len(groups), f"timing {group.name}")
        sub = _subgraph(graph, group)
        step = group_step(group.channels, round_to, group.unit)
        widths = widths_to_time(group.channels, min(max(floor, step), group.channels), step)
        narrowed = [_timing_model(sub if w == group.channels else slice_channels(sub.copy(), group, np.arange(w)),
                                  model) for w in widths]
        ms, _ = median_latencies(narrowed, provider=provider, batch=batch, threads=threads, warmup=warmup, runs=runs)
        zero = [(0, 0.0)] if group.id in removable else []
        table.groups.append(GroupCost(group.id, group.name, group.channels, [w for w, _ in zero] + widths,
                                      [m for _, m in zero] + ms))
    return table


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
    table: dict  # the cost table (see CostTable)
    table_seconds: float  # 0 when read from a file
    table_machine: str | None  # read from a file measured on another machine: what differs



class Spend(Protocol):
    """A budget resolved on one model: the ``cost`` the allocation spends, the ``target`` it must not pass,
    and what the report records of it."""

    cost: Cost
    target: float

    def recorded(self, widths: dict[int, int], target: float, requested: float | None
                 ) -> tuple[float, float | None]:
        """The report's (target_macs, requested_macs) for ``widths`` allocated to ``target`` (raised from
        ``requested`` by best_effort)."""

    def outcome(self, model: onnx.ModelProto, pruned: onnx.ModelProto, widths: dict[int, int], target: float,
                requested: float | None, progress: Callable[[str], None]) -> LatencyReport | None:
        """What the written model achieved beside the MACs (a latency budget: its measured latency)."""


@dataclass
class MacSpend:
    """A MAC budget: the report's target_macs is the budget itself."""

    cost: Cost
    target: float

    def recorded(self, widths: dict[int, int], target: float, requested: float | None
                 ) -> tuple[float, float | None]:
        return target, requested

    def outcome(self, model: onnx.ModelProto, pruned: onnx.ModelProto, widths: dict[int, int], target: float,
                requested: float | None, progress: Callable[[str], None]) -> None:
        return None


@dataclass
class LatencySpend:
    """A latency budget spent through ``cost`` (a table measured in ``seconds``, or read from ``path``); the
    report's target_macs is the MACs its widths come to (``macs``), and the written model is timed at the end."""

    cost: CostTable
    target: float
    ratio: float | None  # the budget as a fraction of the original's latency
    macs: MacModel
    provider: str
    seconds: float
    path: str | None

    def recorded(self, widths: dict[int, int], target: float, requested: float | None
                 ) -> tuple[float, float | None]:
        return self.macs.macs(widths), None

    def outcome(self, model: onnx.ModelProto, pruned: onnx.ModelProto, widths: dict[int, int], target: float,
                requested: float | None, progress: Callable[[str], None]) -> LatencyReport:
        progress("timing the pruned model against the original")
        table = self.cost
        (original_ms, measured_ms), ran = median_latencies([model, pruned], provider=self.provider,
                                                           batch=table.batch, threads=table.threads)
        # A ratio target is judged against the original timed in the same rounds, not the table's older figure.
        bound = target if self.ratio is None else target / table.model_ms * original_ms
        return LatencyReport(target, self.ratio, table(widths), measured_ms, original_ms, measured_ms <= bound, ran,
                             table.batch, table.threads, requested, table.to_dict(), self.seconds,
                             table.other_machine() if self.path else None)
