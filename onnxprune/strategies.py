"""Typed strategies of ``compress``: a budget, a channel selector, a width allocator and a reconstruction.

Each is a frozen dataclass checked when built, and each carries the behaviour it stands for: the pruning
loop (``onnxprune.pipeline``) calls ``Budget.resolve``, ``Allocator.widths``, ``Selector.select`` and
``Reconstruction.apply`` and never compares a name. A strategy of one's own is a subclass implementing
that method (Torch-Pruning's habit of passing an importance object in). ``CompressOptions`` holds one of
each and the plain knobs; ``options_from`` and ``named`` build them as the API and the CLI do.

The strategies reach the run through a ``Context`` (the pipeline's ``Compressor``): this module imports
nothing of ``onnxprune.pipeline``, which imports it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from numbers import Integral
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.tasks import TASKS
from onnxprune.allocation import CURVE_FLOOR, curve_widths, epsilon_widths, lowest_macs, uniform_widths
from onnxprune.analysis import consumers
from onnxprune.analysis.groups import Group
from onnxprune.sensitivity import output_curves, split
from onnxprune.cost import Cost, CostTable, LatencySpend, MacCost, MacSpend, Spend, measure_cost_table
from onnxprune.errors import OptionError, check_choice
from onnxprune.imitation.downstream import ConsumerDownstream
from onnxprune.imitation.global_ import ShortlistPath, evaluations, lu_flops, plan, shortlisted_global, solve_flops
from onnxprune.imitation.local import greedy_local
from onnxprune.imitation.omp import RIDGE as OMP_RIDGE
from onnxprune.imitation.omp import stats_omp, stats_omp_state
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import CV_SOLVES, refit_cv, refit_full, refit_scale
from onnxprune.imitation.stats import neuron_cross, neuron_gram, target_energy
from onnxprune.ir.ort import PROVIDER_CHAINS, first_provider, make_session
from onnxprune.runtime.store import check_memory

if TYPE_CHECKING:
    from onnxprune.analysis import Analysis
    from onnxprune.pipeline import ConsumerData
    from onnxprune.ir.probe import FixedBatch
    from onnxprune.runtime.segments import Liveness
    from onnxprune.runtime.store import Array

TARGETS = ("original", "paper")  # what Local imitates (--target)
Progress = Callable[[int, int, str], None]
Choice = tuple[np.ndarray, np.ndarray, "float | None"]  # kept channels (sorted), fold factors, relative loss


class Context(Protocol):
    """What the strategies read of a run (the pipeline's ``Compressor``)."""

    model: onnx.ModelProto  # as given
    original: gs.Graph  # the unpruned graph
    graph: gs.Graph  # the graph as pruned so far
    analysis: Analysis
    live: Liveness  # the original graph's node positions and live tensors
    inputs: dict[str, Array]  # the calibration samples
    values_p: dict[str, np.ndarray]  # the pruned prefix's cached tensors at the current cut
    options: CompressOptions
    fixed_batch: FixedBatch | None  # the batch the graph fixes, if it does

    def note(self, group: Group, info: dict[str, Any]) -> None:
        """Record what the selector did on ``group`` (its layer report's ``selection``)."""

    def status(self, text: str) -> None:
        """Show what the selection of the current group is doing (progress)."""

    def generator(self, seed: int) -> np.random.Generator:
        """The run's generator of ``seed`` (one per seed, drawn on across groups)."""

    def error_curves(self, order: list[tuple[int, Group]], on_layer: Progress | None) -> dict[int, np.ndarray]:
        """Each group's relative local-imitation loss by width, on the original network."""

    def reference_outputs(self) -> dict[str, np.ndarray]:
        """The original network's outputs on the calibration set."""

    def refit(self, group: Group, data: list[ConsumerData], cols: np.ndarray, priors: list[np.ndarray]
              ) -> tuple[list[float], float]:
        """Least-squares refit of the consumers from their statistics' channels ``cols``: (ridges, error)."""

    def scale(self, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray) -> float:
        """Scale the kept channels' consumer columns by ``fold``: the consumers' summed output error."""


class Strategy:
    """A typed strategy; ``describe()`` is what a report records of it."""

    def describe(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, **(asdict(self) if is_dataclass(self) else {})}


class Budget(Strategy):
    """How small the pruned model must be."""

    def resolve(self, ctx: Context, groups: list[Group], on_layer: Progress | None) -> Spend:
        """The cost the allocation spends on this model and the target it must not pass."""
        raise NotImplementedError

    def timing_batch(self) -> int | None:
        """The batch the budget is timed at (None: not timed)."""
        return None


class Selector(Strategy):
    """Which channels each group keeps."""

    def bind(self, ctx: Context, order: list[tuple[int, Group]], widths: dict[int, int]) -> Selector:
        """The selector of one run, once the widths are known (``order``: the groups with their cuts); by
        default itself. A selector with per-run state (a time budget) returns an object holding it."""
        return self

    def summary(self) -> dict[str, Any] | None:
        """What the report records of the run's selection as a whole (None: nothing)."""
        return None

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        """``width`` channels of ``group`` to keep (sorted), the factor folded into each kept channel's
        consumer columns, and the relative loss of the choice (None if the selector has none)."""
        raise NotImplementedError


class Allocator(Strategy):
    """How many channels each group keeps."""

    needs_curves = True  # reads each group's error curve (``widths``' ``curves``)

    def curves(self, ctx: Context, order: list[tuple[int, Group]], on_layer: Progress | None
               ) -> tuple[dict[int, np.ndarray], dict[str, Any] | None]:
        """The curves ``widths`` reads (``order``: the groups with their cuts), and what the report records of
        measuring them (None: nothing). By default each group's local-imitation loss, if ``needs_curves``."""
        return (ctx.error_curves(order, on_layer) if self.needs_curves else {}), None

    def widths(self, cost: Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
               min_channels: int, round_to: int) -> dict[int, int]:
        """Each group's width, the model's ``cost`` at most ``target``."""
        raise NotImplementedError

    @property
    def floor(self) -> float:
        """The least share of its channels every group keeps with these widths."""
        return 0.0

    def lowest(self, cost: Cost, groups: list[Group], min_channels: int, round_to: int) -> float:
        """The lowest cost these widths can reach (what best_effort prunes to)."""
        return lowest_macs(cost, groups, min_channels, round_to, share=self.floor)


class Reconstruction(Strategy):
    """How the consumers' weights are set after selection."""

    refits_after_gate = False  # refits again the consumers that run after an SE gate the group feeds

    def apply(self, ctx: Context, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
              ) -> tuple[float, list[float]]:
        """Write the consumers' new weights into ``ctx.graph`` (the group already sliced to ``keep``): their
        summed output error and the ridge of each refitted consumer."""
        raise NotImplementedError


@dataclass(frozen=True)
class MACs(Budget):
    """At most ``count`` multiply-accumulates per sample (Conv, ConvTranspose, Gemm, MatMul)."""

    count: float

    def __post_init__(self) -> None:
        if not self.count > 0:
            raise OptionError(f"MACs({self.count}): the MAC budget must be positive", option="target_flops")

    def resolve(self, ctx: Context, groups: list[Group], on_layer: Progress | None) -> Spend:
        return MacSpend(MacCost(ctx.analysis.macs), float(self.count))


@dataclass(frozen=True)
class Ratio(Budget):
    """At most this fraction of the original's MACs, strictly between 0 and 1."""

    value: float

    def __post_init__(self) -> None:
        if not 0 < self.value < 1:
            raise OptionError(f"Ratio({self.value}): the MAC ratio must lie strictly between 0 and 1", option="target_ratio")

    def resolve(self, ctx: Context, groups: list[Group], on_layer: Progress | None) -> Spend:
        return MacSpend(MacCost(ctx.analysis.macs), self.value * ctx.analysis.macs.total)


@dataclass(frozen=True)
class Latency(Budget):
    """A latency budget in ``ms`` or as a ``ratio`` of the original's measured latency (exactly one), timed at
    ``batch`` with ``threads`` intra-op threads on the compress provider, through a per-group cost table
    measured here or read from ``cost_table`` (and written to ``save_cost_table`` when measured)."""

    ms: float | None = None
    ratio: float | None = None
    batch: int = 1
    threads: int | None = None
    cost_table: str | None = None
    save_cost_table: str | None = None

    def __post_init__(self) -> None:
        if (self.ms is None) == (self.ratio is None):
            raise OptionError("Latency needs exactly one of ms=... or ratio=... (a latency in ms or a fraction of the "
                              "original's)", option="target_latency")
        if self.ms is not None and not self.ms > 0:
            raise OptionError(f"Latency(ms={self.ms}) must be positive", option="target_latency")
        if self.ratio is not None and not 0 < self.ratio < 1:
            raise OptionError(f"Latency(ratio={self.ratio}) must lie strictly between 0 and 1", option="target_latency")
        if self.batch < 1 or (self.threads is not None and self.threads < 1):
            raise OptionError(f"Latency(batch={self.batch}, threads={self.threads}): the batch and the thread count "
                              "must be at least 1", option="latency_batch" if self.batch < 1 else "threads")
        for name in ("cost_table", "save_cost_table"):  # a Path is kept as its text (reports are JSON)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, str(getattr(self, name)))

    def timing_batch(self) -> int | None:
        return self.batch

    def resolve(self, ctx: Context, groups: list[Group], on_layer: Progress | None) -> Spend:
        t0 = time.perf_counter()
        table = self.table(ctx, groups, on_layer)
        seconds = 0.0 if self.cost_table else time.perf_counter() - t0
        target = self.ms if self.ms is not None else self.ratio * table.model_ms
        return LatencySpend(table, target, self.ratio, ctx.analysis.macs, ctx.options.provider, seconds,
                            self.cost_table)

    def table(self, ctx: Context, groups: list[Group], on_layer: Progress | None) -> CostTable:
        """The latency cost table: read from ``cost_table``, or measured (and saved when asked)."""
        options = ctx.options
        if self.cost_table:
            table = CostTable.load(self.cost_table, groups)
            table.refuse_another_setup(self.cost_table, ctx.model, first_provider(options.provider), self.batch,
                                       self.threads)
            return table
        table = measure_cost_table(ctx.model, ctx.original, groups, provider=options.provider, batch=self.batch,
                                   threads=self.threads, floor=options.min_channels, round_to=options.round_to,
                                   on_group=on_layer, removable=ctx.analysis.blocks)
        if self.save_cost_table:
            table.save(self.save_cost_table)
        return table


@dataclass(frozen=True)
class OMP(Selector):
    """Group orthogonal matching pursuit: greedy forward selection on the refitted consumers' output error."""

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        path = stats_omp([d.stats for d in data], [d.current.k for d in data], width)
        keep = path.support(width)
        return keep, np.ones(width), float(path.curve[width] / max(path.curve[0], np.finfo(float).tiny))


@dataclass(frozen=True)
class Local(Selector):
    """The paper's greedy local imitation of ``imitate``: 'original' (the original network's layer output)
    or 'paper' (the layer's own output on the pruned prefix); ``--target`` on the command line."""

    imitate: str = "original"

    def __post_init__(self) -> None:
        if self.imitate not in TARGETS:
            raise OptionError(f"Local(imitate={self.imitate!r}): imitate is not one of {', '.join(TARGETS)}",
                              option="target")

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        n = group.channels
        G, c, tau = self.quadratic(group, data)
        path = greedy_local(G, c, tau, max_steps=3 * width)
        keep = path.support(width)
        a = path.weights(width)
        rel = float(path.curve[width] / tau) if tau > 0 and np.isfinite(path.curve[width]) else None
        return keep, n * a[keep], rel

    def quadratic(self, group: Group, data: list[ConsumerData]) -> tuple[np.ndarray, np.ndarray, float]:
        """(G, c, tau) of the local imitation loss aᵀGa - 2cᵀa + tau towards ``imitate``."""
        n = group.channels
        G = sum(neuron_gram(d.stats.xx, d.current.weight, d.current.k) for d in data)
        if self.imitate == "paper":
            return G, G.sum(axis=1) / n, float(G.sum()) / n**2
        c = sum(neuron_cross(d.stats.xt, d.stats.sx, d.current.weight, d.current.k, d.original.bias)
                for d in data) / n
        tau = sum(target_energy(d.stats.tt, d.stats.st, d.stats.count, d.original.bias) for d in data) / n**2
        return G, c, tau


class _OutOfTime(Exception):
    """A global search stopped at ``step`` (0-based) of ``steps``: its share of ``auto``'s budget ran out."""

    def __init__(self, step: int, steps: int) -> None:
        super().__init__(f"step {step + 1}/{steps}")
        self.step, self.steps = step, steps


class _Search:
    """One group's end-to-end judge: its consumers refitted on a candidate support and the network after the cut
    run on chosen samples (``ConsumerDownstream``). Global mini-batches come from one half of the calibration
    samples (``fit``), ``auto``'s comparison from the other (``held``, at most ``held`` of them)."""

    def __init__(self, ctx: Context, group: Group, data: list[ConsumerData], held: int) -> None:
        reference = ctx.reference_outputs()
        self.fit, self.held = split(len(next(iter(reference.values()))), 1 << 62, held, need=1,
                                    who=("global imitation", "select with omp", "method"))
        self.data = data
        self.downstream = ConsumerDownstream(
            ctx.graph, ctx.values_p, [d.use.node for d in data], reference, provider=ctx.options.provider,
            exact_batch=None if ctx.fixed_batch is None else ctx.fixed_batch.size)
        nodes = {n.name: n for n in ctx.graph.nodes}
        self.bases = [consumers.cleared(ctx.graph, nodes[d.use.node], group, d.use) for d in data]

    def linears(self, keep: np.ndarray, cross_validated: bool = False) -> list[consumers.Linear]:
        """Every consumer refitted on channels ``keep``: plain ridge least squares (the OMP's ridge), or
        ``cross_validated`` towards the current weights as ``Refit`` writes it."""
        out = []
        for d, base in zip(self.data, self.bases):
            cols = expand(keep, d.current.k)
            if cross_validated:
                w, bias, _ = refit_cv(d.folds, cols, prior=d.current.weight[:, cols])
            else:
                w, bias = refit_full(d.stats, cols, OMP_RIDGE)
            out.append(base.with_group(cols, w, bias))
        return out

    def path(self, ctx: Context, group: Group, width: int, search: GlobalSearch, until: float = float("inf"),
             clock: Callable[[], float] = time.perf_counter) -> ShortlistPath:
        """The shortlisted global path of ``group`` to ``width`` channels; ``_OutOfTime`` once ``clock`` passes
        ``until`` (read before each candidate's refit and each step's scoring)."""
        rank = stats_omp_state([d.stats for d in self.data], [d.current.k for d in self.data], width)
        batches: dict[int, tuple] = {}
        steps = len(plan(group.channels, width, search.steps, search.shortlist))

        def in_time(step: int) -> None:
            if clock() > until:
                raise _OutOfTime(step, steps)

        def losses(supports: Sequence[np.ndarray], step: int) -> np.ndarray:
            ctx.status(f"global imitation, step {step + 1}/{steps} ({len(supports)} candidates)")
            if step not in batches:
                batches.clear()
                rng = np.random.default_rng([search.seed, group.id, step])
                idx = np.sort(rng.choice(self.fit, min(search.samples, len(self.fit)), replace=False))
                batches[step] = self.downstream.samples(idx)
            linears = []
            for keep in supports:
                in_time(step)
                linears.append(self.linears(keep))
            in_time(step)
            return self.downstream.losses(linears, batches[step])

        return shortlisted_global(rank, losses, group.channels, width, steps=search.steps, shortlist=search.shortlist)

    def judge(self, keeps: Sequence[np.ndarray]) -> np.ndarray:
        """The discrepancy of each support with ``Refit``'s weights on the held samples."""
        return self.downstream.losses([self.linears(k, cross_validated=True) for k in keeps],
                                      self.downstream.samples(self.held))


@dataclass(frozen=True)
class GlobalSearch:
    """Shortlisted global imitation (``onnxprune.imitation.global_.shortlisted_global``): the network's final
    output (KL for classifiers, relative squared error otherwise) decides which channels enter, among the
    group OMP's best, each candidate with its consumers refitted; ``steps`` steps per group, at least
    ``shortlist`` candidates a step, ``samples`` calibration samples a step drawn with ``seed``."""

    seed: int = 0
    steps: int = 8
    shortlist: int = 4
    samples: int = 32

    def __post_init__(self) -> None:
        for name in ("steps", "shortlist", "samples"):
            if getattr(self, name) < 1:
                raise OptionError(f"{type(self).__name__}({name}={getattr(self, name)}): must be at least 1",
                                  option="method")

    def evaluations(self, group: Group, width: int) -> int:
        """Candidate evaluations of its search on ``group`` kept to ``width``."""
        return evaluations(group.channels, width, self.steps, self.shortlist)


@dataclass(frozen=True)
class Global(GlobalSearch, Selector):
    """Global imitation on every group (see ``GlobalSearch``); the consumers are then reconstructed as usual."""

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        t0 = time.perf_counter()
        path = _Search(ctx, group, data, held=1).path(ctx, group, width, self)
        ctx.note(group, {"method": "global", "evaluations": int(path.evaluated.sum()),
                         "seconds": time.perf_counter() - t0})
        return path.support(width), np.ones(width), None


DEFAULT_GLOBAL_BUDGET = 300.0
"""Seconds ``auto`` may spend on global imitation by default: MobileNetV2 on 500 photos stays within ten
minutes on two CPU cores (its OMP run takes about one)."""


@dataclass(frozen=True)
class Auto(GlobalSearch, Selector):
    """The paper's per-layer choice (its Algorithm 2): OMP and global imitation both select, each choice is refitted
    as ``Refit`` writes it and scored on the network's output on ``held`` calibration samples that global
    imitation never saw, and the lower wins. Global imitation runs only within ``budget`` seconds: the groups
    nearest the output first (where the paper found it helps), each only when its predicted cost, with that of
    the later groups it was planned for, fits in what is left. ``clock`` reads seconds (a fake one in tests)."""

    budget: float = DEFAULT_GLOBAL_BUDGET
    held: int = 128
    clock: Callable[[], float] = field(default=time.perf_counter, compare=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.budget >= 0:
            raise OptionError(f"Auto(budget={self.budget}): the global budget is seconds, at least 0",
                              option="global_budget")
        if self.held < 1:
            raise OptionError(f"Auto(held={self.held}): at least 1 held sample", option="method")

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in super().describe().items() if k != "clock"}

    def bind(self, ctx: Context, order: list[tuple[int, Group]], widths: dict[int, int]) -> Selector:
        return _AutoRun(self, ctx, order, widths)


class TimeBudget:
    """Which groups global imitation may run on within ``budget`` seconds, given each one's ``predicted`` seconds
    (group id -> seconds, in pruning order; a group missing is not a candidate).

    The plan takes the groups nearest the output first while their predictions fit. When a planned group comes,
    it runs only if its prediction plus those of the planned groups after it fits in what is left; predictions
    are scaled by measured / predicted over the groups run so far."""

    def __init__(self, budget: float, predicted: dict[int, float]) -> None:
        self.budget = budget
        self.predicted = predicted
        self.plan: list[int] = []  # nearest the output first
        planned = 0.0
        for gid in reversed(list(predicted)):
            if planned + predicted[gid] <= budget:
                self.plan.append(gid)
                planned += predicted[gid]
        self.spent = 0.0
        self.done = [0.0, 0.0]  # measured and predicted seconds of the groups run so far

    @property
    def scale(self) -> float:
        return self.done[0] / self.done[1] if self.done[1] > 0 else 1.0

    def _later(self, gid: int) -> float:
        return sum(self.predicted[g] for g in self.plan[: self.plan.index(gid)]) * self.scale

    def allows(self, gid: int) -> str | None:
        """None if global imitation may run on group ``gid`` now, else why not."""
        if gid not in self.plan:
            return "global not planned: the budget went to the groups nearer the output"
        mine = self.predicted[gid] * self.scale
        later = self._later(gid)
        left = self.budget - self.spent
        if mine + later > left:
            return f"global skipped: predicted {mine:.1f} s (+{later:.1f} s planned later) > {left:.1f} s left"
        return None

    def share(self, gid: int) -> float:
        """Seconds group ``gid`` may take: what is left less the predictions of the planned groups after it."""
        return self.budget - self.spent - self._later(gid)

    def spend(self, gid: int, seconds: float, finished: bool = True) -> None:
        """Count ``seconds`` spent on ``gid``; a search stopped before its end does not rescale the predictions."""
        self.spent += seconds
        if finished:
            self.done[0] += seconds
            self.done[1] += self.predicted[gid]


class _AutoRun(Selector):
    """``Auto`` on one run: the predicted seconds of global imitation on each group and the ``TimeBudget``."""

    def __init__(self, auto: Auto, ctx: Context, order: list[tuple[int, Group]], widths: dict[int, int]) -> None:
        self.auto = auto
        self.row_seconds = _row_seconds(ctx, auto.samples)
        self.flop_seconds = _flop_seconds()
        total = ctx.analysis.macs.total or 1
        nodes = {n.name: n for n in ctx.graph.nodes}
        predicted = {}
        self.judge_seconds: dict[int, float] = {}  # the judge's share of each prediction
        for cut, group in order:
            width = widths[group.id]
            if 0 < width < group.channels:
                row = sum(e.macs for e in ctx.analysis.macs.entries
                          if ctx.live.position[e.node] >= cut) / total * self.row_seconds
                shapes = [(consumers.group_view(ctx.graph, nodes[u.node], group, u).k,
                           consumers.matrix(nodes[u.node]).weight.shape[0]) for u in group.consumers]
                search = (auto.evaluations(group, width) * auto.samples * row
                          + solve_flops(group.channels, width, auto.steps, auto.shortlist, shapes) * self.flop_seconds)
                # the judge: both choices refitted as Refit does (cross-validated), then run on the held samples
                self.judge_seconds[group.id] = 2 * (auto.held * row + CV_SOLVES * self.flop_seconds * sum(
                    lu_flops(width * k, outputs) for k, outputs in shapes))
                predicted[group.id] = search + self.judge_seconds[group.id]
        self.time = TimeBudget(auto.budget, predicted)

    def summary(self) -> dict[str, Any]:
        return {"budget_s": self.auto.budget, "spent_s": self.time.spent, "row_seconds": self.row_seconds,
                "flop_seconds": self.flop_seconds, "planned": len(self.time.plan),
                "measured_over_predicted": self.time.scale}

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        omp = OMP().select(ctx, group, data, width)
        why = self.time.allows(group.id)
        if why is not None:
            ctx.note(group, {"method": "omp", "why": why})
            return omp
        t0 = self.auto.clock()
        share = self.time.share(group.id)
        predicted = self.time.predicted[group.id] * self.time.scale
        until = t0 + share - self.judge_seconds[group.id] * self.time.scale  # the judgement's time kept for it
        search = _Search(ctx, group, data, self.auto.held)
        try:
            path = search.path(ctx, group, width, self.auto, until=until, clock=self.auto.clock)
        except _OutOfTime as stop:
            seconds = self.auto.clock() - t0
            self.time.spend(group.id, seconds, finished=False)
            ctx.note(group, {"method": "omp", "seconds": seconds, "predicted_s": predicted,
                             "why": f"global stopped at {stop}: its {share:.1f} s of the budget ran out"})
            return omp
        keep = path.support(width)
        d_omp, d_global = search.judge([omp[0], keep])
        seconds = self.auto.clock() - t0
        self.time.spend(group.id, seconds)
        won = d_global < d_omp
        ctx.note(group, {"method": "global" if won else "omp", "omp": float(d_omp), "global": float(d_global),
                         "seconds": seconds, "predicted_s": predicted, "evaluations": int(path.evaluated.sum()),
                         "why": "the lower output discrepancy on the held samples"})
        return (keep, np.ones(width), None) if won else omp


def _flop_seconds(d: int = 512, outputs: int = 64) -> float:
    """Seconds per floating-point operation of a least-squares solve (``solve_flops``) on this machine, from the
    faster of two timed d-unknown solves."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((d, d))
    a = a @ a.T + d * np.eye(d)
    b = rng.standard_normal((d, outputs))
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        np.linalg.solve(a, b)
        best = min(best, time.perf_counter() - t0)
    return best / lu_flops(d, outputs)


def _row_seconds(ctx: Context, rows: int) -> float:
    """Seconds of one sample through the whole original network (onnxruntime, ``rows`` samples a run)."""
    session, _ = make_session(ctx.model, ctx.options.provider, arena=False)
    n = len(next(iter(ctx.inputs.values())))
    rows = ctx.fixed_batch.size if ctx.fixed_batch is not None else min(rows, n)
    feed = {k: np.ascontiguousarray(v[np.arange(rows) % n]) for k, v in ctx.inputs.items()}
    session.run(None, feed)
    t0 = time.perf_counter()
    session.run(None, feed)
    return (time.perf_counter() - t0) / rows


@dataclass(frozen=True)
class L1(Selector):
    """Baseline: the channels of largest producer-weight L1 norm."""

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        n = group.channels
        norms = np.zeros(n)
        nodes = {node.name: node for node in ctx.graph.nodes}
        tensors = ctx.graph.tensors()
        for site in group.slices:
            if site.node in group.producers and site.input_index == 1:
                w = np.abs(np.asarray(nodes[site.node].inputs[1].values, dtype=np.float64))
                w = np.take(w, group.entries(tensors, site.tensor, site.offset, site.repeat), axis=site.axis)
                norms += np.moveaxis(w, site.axis, 0).reshape(n, -1).sum(axis=1)
        return np.sort(np.argsort(-norms, kind="stable")[:width]), np.ones(width), None


@dataclass(frozen=True)
class Random(Selector):
    """Baseline: channels drawn at random with ``seed``."""

    seed: int = 0

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        return np.sort(ctx.generator(self.seed).choice(group.channels, width, replace=False)), np.ones(width), None


@dataclass(frozen=True)
class Epsilon(Allocator):
    """One threshold on every layer's relative imitation loss (the paper's rule), searched to meet the budget."""

    def widths(self, cost: Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
               min_channels: int, round_to: int) -> dict[int, int]:
        return epsilon_widths(cost, groups, curves, target, min_channels, round_to)


@dataclass(frozen=True)
class Uniform(Allocator):
    """The same keep ratio in every group."""

    needs_curves = False

    def widths(self, cost: Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
               min_channels: int, round_to: int) -> dict[int, int]:
        return uniform_widths(cost, groups, target, min_channels, round_to)


@dataclass(frozen=True)
class Curve(Allocator):
    """Greedy on the per-layer error curves, each layer keeping at least 25%."""

    def widths(self, cost: Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
               min_channels: int, round_to: int) -> dict[int, int]:
        return curve_widths(cost, groups, curves, target, min_channels, round_to)

    @property
    def floor(self) -> float:
        return CURVE_FLOOR


@dataclass(frozen=True)
class Output(Allocator):
    """Judged on the network's output: each group alone is pruned (OMP and refit, on ``fit_samples``
    calibration samples) to each of ``ratios`` of its channels, the output's discrepancy to the original's
    measured on ``probe_samples`` others (``onnxprune.sensitivity``); the greedy then narrows where the
    interpolated discrepancy grows least per unit of cost saved, never below the narrowest ratio. With
    ``remove_blocks``, removing a residual block whole (``analysis.blocks``) is probed too and is one more
    step the greedy may take."""

    ratios: tuple[float, ...] = (0.75, 0.5, 0.25)
    fit_samples: int = 64
    probe_samples: int = 32
    remove_blocks: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratios", tuple(float(r) for r in self.ratios))
        if not self.ratios or not all(0 < r < 1 for r in self.ratios):
            raise OptionError(f"Output(ratios={self.ratios}): each ratio must lie strictly between 0 and 1",
                              option="allocation")
        if self.fit_samples < 2 or self.probe_samples < 1:
            raise OptionError(f"Output(fit_samples={self.fit_samples}, probe_samples={self.probe_samples}): at "
                              "least 2 samples to fit on and 1 to probe on", option="allocation")

    def curves(self, ctx: Context, order: list[tuple[int, Group]], on_layer: Progress | None
               ) -> tuple[dict[int, np.ndarray], dict[str, Any] | None]:
        curves, sensitivity = output_curves(ctx, order, self.ratios, self.fit_samples, self.probe_samples, on_layer,
                                            ctx.analysis.blocks if self.remove_blocks else ())
        return curves, asdict(sensitivity)

    def widths(self, cost: Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
               min_channels: int, round_to: int) -> dict[int, int]:
        return curve_widths(cost, groups, curves, target, min_channels, round_to, floor=min(self.ratios))

    @property
    def floor(self) -> float:
        return min(self.ratios)


@dataclass(frozen=True)
class NoRefit(Reconstruction):
    """Keep the consumers' weights, folding the selector's per-channel factors (the paper's N·a_i)."""

    def apply(self, ctx: Context, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
              ) -> tuple[float, list[float]]:
        return ctx.scale(group, data, keep, fold), []


@dataclass(frozen=True)
class Scale(Reconstruction):
    """A least-squares scale per kept channel, with relative ``ridge``."""

    ridge: float = 1e-4

    def __post_init__(self) -> None:
        if not self.ridge >= 0:
            raise OptionError(f"Scale(ridge={self.ridge}): the ridge must be at least 0")

    def apply(self, ctx: Context, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
              ) -> tuple[float, list[float]]:
        G = sum(neuron_gram(d.stats.xx, d.current.weight, d.current.k) for d in data)[np.ix_(keep, keep)]
        c = sum(neuron_cross(d.stats.xt, d.stats.sx, d.current.weight, d.current.k, d.original.bias)
                for d in data)[keep]
        return ctx.scale(group, data, keep, refit_scale(G, c, ridge=self.ridge)), []


@dataclass(frozen=True)
class Refit(Reconstruction):
    """A full least-squares refit of every consumer, its ridge chosen by cross-validation."""

    refits_after_gate = True

    def apply(self, ctx: Context, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
              ) -> tuple[float, list[float]]:
        ridges, err = ctx.refit(group, data, keep, [d.current.weight[:, expand(keep, d.current.k)] for d in data])
        return err, ridges


def _kind(value: object, kind: type[Strategy], name: str) -> Strategy:
    """``value`` itself if it is a ``kind``; else an OptionError naming the ``kind``s to choose from."""
    if not isinstance(value, kind):
        choices = ", ".join(f"{c.__name__}()" for c in _subclasses(kind))
        raise OptionError(f"{name}={value!r}: give one of {choices} (a {kind.__name__} of onnxprune.strategies)")
    return value


def _subclasses(kind: type) -> list[type]:
    return [c for c in kind.__subclasses__() if c.__module__ == __name__ and not c.__name__.startswith("_")]


@dataclass
class CompressOptions:
    """What to prune and how: one strategy of each kind (checked to be one) and the plain knobs."""

    budget: Budget
    select: Selector = OMP()
    allocate: Allocator = Output()
    reconstruct: Reconstruction = Refit()
    min_channels: int = 1
    round_to: int = 8
    curve_samples: int = 128  # calibration samples (evenly spaced) for the allocation's error curves
    batch_size: int = 32
    provider: str = "auto"
    best_effort: bool = False  # a budget below the lowest reachable MACs prunes to those instead of failing
    residual_streams: bool = False  # also prune the channels that residual Adds sum across blocks, jointly
    memory: int | None = None  # bytes of cached activations held in RAM, the rest spilled to disk (None: half
    # of the memory available when compress starts)
    spill_dir: str | None = None  # where spilled activations go (None: the system's temporary folder)
    task: str = "auto"  # how the output allocation reads the outputs (``onnxprune.tasks``): "raw" for plain L2

    def __post_init__(self) -> None:
        for name, kind in STRATEGY_KINDS.items():
            _kind(getattr(self, name), kind, name)
        check_memory(self.memory)
        for name in ("min_channels", "round_to", "curve_samples", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise OptionError(f"{name}={value!r}: a whole number of at least 1 (--{name.replace('_', '-')})")
        check_choice("provider", self.provider, ("auto", *PROVIDER_CHAINS))
        check_choice("task", self.task, TASKS)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: each strategy as its ``describe()`` ({"kind": "OMP", ...}), the knobs as they are."""
        return {f.name: getattr(self, f.name).describe() if f.name in STRATEGY_KINDS else getattr(self, f.name)
                for f in fields(self)}


STRATEGY_KINDS: dict[str, type[Strategy]] = {"budget": Budget, "select": Selector, "allocate": Allocator,
                                             "reconstruct": Reconstruction}


def options_from(budget: Budget, select: Selector = OMP(), allocate: Allocator = Output(),
                 reconstruct: Reconstruction = Refit(), **rest: Any) -> CompressOptions:
    """The ``CompressOptions`` of one strategy of each kind; ``rest`` sets the other fields
    (``round_to``, ``batch_size``, ``provider``, ``best_effort``, ...)."""
    free = {f.name for f in fields(CompressOptions)} - set(STRATEGY_KINDS)
    unknown = sorted(set(rest) - free)
    if unknown:
        raise OptionError(f"compress option(s) {', '.join(unknown)} are not among {', '.join(sorted(free))}: "
                          "the budget and the strategies set the others")
    return CompressOptions(budget, select, allocate, reconstruct, **rest)


SELECTORS: dict[str, type[Selector]] = {"omp": OMP, "local": Local, "global": Global, "auto": Auto, "l1": L1,
                                        "random": Random}
ALLOCATORS: dict[str, type[Allocator]] = {"epsilon": Epsilon, "uniform": Uniform, "curve": Curve, "output": Output}
RECONSTRUCTORS: dict[str, type[Reconstruction]] = {"full": Refit, "scale": Scale, "none": NoRefit}
METHODS, ALLOCATIONS, RECONSTRUCTIONS = tuple(SELECTORS), tuple(ALLOCATORS), tuple(RECONSTRUCTORS)


def named(method: str, allocation: str, reconstruct: str, target: str = "original", seed: int = 0,
          remove_blocks: bool = False, global_budget: float | None = None) -> tuple[Selector, Allocator, Reconstruction]:
    """The strategies named as on the command line: ``target`` goes to ``Local``, ``seed`` to ``Random``, ``Global``
    and ``Auto``, ``global_budget`` to ``Auto``, ``remove_blocks`` to ``Output``; an unknown name is an OptionError
    listing the valid ones."""
    check_choice("method", method, METHODS)
    check_choice("target", target, TARGETS)
    check_choice("allocation", allocation, ALLOCATIONS)
    check_choice("reconstruct", reconstruct, RECONSTRUCTIONS)
    if remove_blocks and ALLOCATORS[allocation] is not Output:
        raise OptionError(f"block removal is chosen by the output allocation, not by {allocation}: use "
                          "--allocation output with --remove-blocks", option="remove_blocks")
    if global_budget is not None and SELECTORS[method] is not Auto:
        raise OptionError(f"the global budget is auto's, not {method}'s: use --method auto with --global-budget",
                          option="global_budget")
    kind = SELECTORS[method]
    if kind is Auto:
        select = Auto(seed=seed, budget=DEFAULT_GLOBAL_BUDGET if global_budget is None else global_budget)
    else:
        select = kind(target) if kind is Local else kind(seed) if kind in (Random, Global) else kind()
    allocate = Output(remove_blocks=True) if remove_blocks else ALLOCATORS[allocation]()
    return select, allocate, RECONSTRUCTORS[reconstruct]()
