"""``auto``: OMP and global imitation on each group, the better on held samples kept, global imitation run within
a time budget that a scheduler spends on the groups nearest the output first."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxprune.analysis import consumers
from onnxprune.analysis.groups import Group
from onnxprune.core.context import Choice, ConsumerData, Context
from onnxprune.errors import OptionError
from onnxprune.imitation.global_ import lu_flops, solve_flops
from onnxprune.imitation.refit import CV_SOLVES
from onnxprune.ir.ort import make_session
from onnxprune.strategies.base import Selector
from onnxprune.strategies.global_search import GlobalSearch, OutOfTime, Search
from onnxprune.strategies.selectors import OMP


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
        search = Search(ctx, group, data, self.auto.held)
        try:
            path = search.path(ctx, group, width, self.auto, until=until, clock=self.auto.clock)
        except OutOfTime as stop:
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
