"""Global imitation: a group's channels chosen by the network's final output, each candidate's consumers refitted."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from onnxprune.analysis import consumers
from onnxprune.analysis.groups import Group
from onnxprune.core.context import Choice, ConsumerData, Context
from onnxprune.errors import OptionError
from onnxprune.imitation.global_ import ShortlistPath, evaluations, plan, shortlisted_global
from onnxprune.imitation.omp import RIDGE as OMP_RIDGE
from onnxprune.imitation.omp import stats_omp_state
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import refit_cv, refit_full
from onnxprune.strategies.base import Selector
from onnxprune.strategies.downstream import ConsumerDownstream
from onnxprune.strategies.sensitivity import split


class OutOfTime(Exception):
    """A global search stopped at ``step`` (0-based) of ``steps``: its share of ``auto``'s budget ran out."""

    def __init__(self, step: int, steps: int) -> None:
        super().__init__(f"step {step + 1}/{steps}")
        self.step, self.steps = step, steps


class Search:
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
                w, bias, _ = refit_cv(d.folds, cols, prior=d.current.weight[:, cols], merged=d.stats)
            else:
                w, bias = refit_full(d.stats, cols, OMP_RIDGE)
            out.append(base.with_group(cols, w, bias))
        return out

    def path(self, ctx: Context, group: Group, width: int, search: GlobalSearch, until: float = float("inf"),
             clock: Callable[[], float] = time.perf_counter) -> ShortlistPath:
        """The shortlisted global path of ``group`` to ``width`` channels; ``OutOfTime`` once ``clock`` passes
        ``until`` (read before each candidate's refit and each step's scoring)."""
        rank = stats_omp_state([d.stats for d in self.data], [d.current.k for d in self.data], width)
        batches: dict[int, tuple] = {}
        steps = len(plan(group.channels, width, search.steps, search.shortlist))

        def in_time(step: int) -> None:
            if clock() > until:
                raise OutOfTime(step, steps)

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
        path = Search(ctx, group, data, held=1).path(ctx, group, width, self)
        ctx.note(group, {"method": "global", "evaluations": int(path.evaluated.sum()),
                         "seconds": time.perf_counter() - t0})
        return path.support(width), np.ones(width), None
