"""Greedy global imitation: the paper's (``greedy_global``) and the shortlisted one with refitted consumers
(``shortlisted_global``, what ``--method global`` and ``auto`` run).

Shortlisted global imitation. The final-output discrepancy decides which channels enter, but each step
evaluates it only for a shortlist, and the consumers' weights of every candidate support are refitted by least
squares (so a channel enters with the weights the refit would give it, not the fold's N·γ, and no first-order
approximation is involved). From the empty support S, each step takes m = ceil(width / steps) channels:

* the group OMP ranks every channel not in S by how much it lowers the refitted consumers' output error
  (exact, from the streamed statistics: ``GroupOmp.gains``);
* its best ``s = max(shortlist, 2m)`` (at most the channels left) are evaluated exactly: the discrepancy of
  S ∪ {c}, each on the step's mini-batch;
* the m with the lowest discrepancy join S (and the OMP state).

A layer costs about 2·width discrepancy evaluations (``evaluations``) of B samples through the network after
its cut, whatever ``steps`` is; ``steps = width`` with ``shortlist = N`` is the exhaustive greedy (every channel
evaluated at every step).

The paper's global imitation (Ye, Wu & Liu 2020, sec. 2.3 and appendix "Details on Taylor
Approximation Tricks"), ``greedy_global``:

A group of N channels is scaled by a simplex weight vector a: channel i of the consumers' input
is multiplied by N·a_i (a = 1/N is the original network). Global imitation chooses a to minimise
the discrepancy D(a) between the network's final output and the original one, greedily:

* k = 0: the best single neuron a = e_i (every i evaluated exactly);
* k >= 1, γ_k = 1/(k+1): a <- (1-γ_k) a + γ_k e_i with the best i. While k <= ``exact_until``
  every i is evaluated exactly; afterwards the Taylor trick ranks the neurons by
  gr_i = 2 Σ_j (1[j=i] - a_j) r_j, r = ∂D/∂b at b = 0 for the auxiliary mask N·(a + b) (one
  backward pass), and only the ``shortlist`` best-ranked (smallest gr_i: steepest descent) are
  evaluated exactly.

The algorithm only sees two callbacks (``losses`` and ``grad``, see ``greedy_global``), so it is
testable without a network; ``onnxprune.imitation.downstream.DownstreamObjective`` builds them
from an ONNX graph.

With γ_k = 1/(k+1) the weights are always counts / (k+1) (how often each neuron was picked), so
a is kept as exact integer counts: supports only grow, by at most one channel a step, and every
support size from 1 to the final one is visited.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from onnxprune.imitation.omp import ChannelOrder
from onnxprune.imitation.path import WidthPath

LossFn = Callable[[np.ndarray, int], np.ndarray]
"""losses(A, step): A is (K, N) candidate simplex weights; returns the K discrepancies (same
mini-batch for every row of one step)."""

GradFn = Callable[[np.ndarray, int], np.ndarray]
"""grad(a, step): r = ∂D/∂b at b = 0 (N,) for the mask N·(a + b), on the step's mini-batch."""

__all__ = ["GlobalPath", "ShortlistPath", "evaluations", "greedy_global", "plan", "shortlisted_global", "taylor_scores"]


class Ranker(Protocol):
    """What ranks the candidates of a step (``omp.GroupOmp``)."""

    def gains(self) -> np.ndarray:
        """(N,) how much each channel would help; -inf for the chosen."""

    def add(self, c: int) -> float:
        """Choose channel c."""


SupportLosses = Callable[[Sequence[np.ndarray], int], np.ndarray]
"""losses(supports, step): the discrepancy of each candidate support (sorted channel indices), all on step's
mini-batch."""


@dataclass
class ShortlistPath(ChannelOrder):
    """Trace of ``shortlisted_global``: ``order`` the channels as they entered; per step, the loss of its best
    candidate (``losses``, NaN where the shortlist was the channels taken and nothing was evaluated), the
    channels it took (``taken``) and the candidates it evaluated (``evaluated``)."""

    losses: np.ndarray
    taken: np.ndarray
    evaluated: np.ndarray


def plan(n: int, width: int, steps: int, shortlist: int) -> list[tuple[int, int]]:
    """(channels taken, candidates evaluated) of each step."""
    if not 1 <= width <= n:
        raise ValueError(f"width {width} outside [1, {n}]")
    if steps < 1 or shortlist < 1:
        raise ValueError(f"steps ({steps}) and shortlist ({shortlist}) must be positive")
    per, plan, chosen = math.ceil(width / steps), [], 0
    while chosen < width:
        take = min(per, width - chosen)
        size = min(n - chosen, max(shortlist, 2 * take))
        plan.append((take, size if size > take else 0))
        chosen += take
    return plan


def evaluations(n: int, width: int, steps: int, shortlist: int) -> int:
    """Candidate evaluations of ``shortlisted_global`` on a group of ``n`` channels kept to ``width``."""
    return sum(size for _, size in plan(n, width, steps, shortlist))


def lu_flops(d: int, outputs: int) -> float:
    """Floating-point operations of an LU solve of d unknowns for ``outputs`` right-hand sides."""
    return 2 / 3 * d ** 3 + 2 * d ** 2 * outputs


def solve_flops(n: int, width: int, steps: int, shortlist: int, consumers: Sequence[tuple[int, int]]) -> float:
    """Floating-point operations of the least-squares solves of ``shortlisted_global``'s candidates: each refits
    every consumer, ``(k, outputs)`` (k columns per channel), on its support (the channels taken so far and
    itself): an LU solve of d = |S|·k unknowns (``lu_flops``)."""
    total, chosen = 0.0, 0
    for take, size in plan(n, width, steps, shortlist):
        total += size * sum(lu_flops((chosen + 1) * k, outputs) for k, outputs in consumers)
        chosen += take
    return total


def shortlisted_global(rank: Ranker, losses: SupportLosses, n: int, width: int, *, steps: int = 8,
                       shortlist: int = 4) -> ShortlistPath:
    """Shortlisted greedy global imitation (see the module docstring): ``width`` of ``n`` channels in ``steps``
    steps (or more, when ``width`` does not divide), each evaluating the ``max(shortlist, 2m)`` channels that
    ``rank`` puts first."""
    order: list[int] = []
    trace = []
    for step, (take, size) in enumerate(plan(n, width, steps, shortlist)):
        gains = np.asarray(rank.gains(), dtype=np.float64)
        first = np.argsort(-gains, kind="stable")[: max(size, take)]
        if size:
            vals = np.asarray(losses([np.sort(np.array([*order, c])) for c in first], step), dtype=np.float64)
            if vals.shape != (len(first),):
                raise ValueError(f"losses callback returned {vals.shape} for {len(first)} candidates")
            best = float(vals.min())
            first = first[np.argsort(vals, kind="stable")[:take]]
        else:
            best = float("nan")
        for c in first:
            rank.add(int(c))
            order.append(int(c))
        trace.append((best, take, size))
    losses_, taken, evaluated = (np.array(col) for col in zip(*trace))
    return ShortlistPath(np.array(order, dtype=np.int64), losses_, taken, evaluated)


def taylor_scores(a: np.ndarray, r: np.ndarray) -> np.ndarray:
    """gr_i = 2 Σ_j (1[j=i] - a_j) r_j = 2 (r_i - aᵀr): the derivative of D along a -> e_i
    (scaled by the paper's factor 2); smaller is a steeper descent."""
    r = np.asarray(r, dtype=np.float64)
    return 2.0 * (r - float(np.asarray(a, dtype=np.float64) @ r))


@dataclass(kw_only=True)
class GlobalPath(WidthPath):
    """Trace of one greedy global run.

    losses[k], supports[k]: loss (on step k's mini-batch) and support size after k steps
    (k = 0 is the best single neuron). picks[k]: the neuron added/re-weighted at step k.
    exact[k]: whether step k evaluated every neuron (False: Taylor shortlist).
    curve[n], best[n], weights/support/padded: see WidthPath.
    order: channels in the order they first entered the support.
    final: the weights a where the greedy stopped. evaluations: candidate evaluations in total.
    Padding channels are the unselected ones with the best (smallest) Taylor score gr_i (one extra
    `grad` call on the mini-batch of the step that reached that state, cached); without a `grad`
    callback the lowest unselected indices pad.
    """

    losses: np.ndarray
    supports: np.ndarray
    picks: np.ndarray
    exact: np.ndarray
    order: np.ndarray
    final: np.ndarray
    evaluations: int
    best_step: dict[int, int] = field(repr=False)
    """support size -> the step at which best[n] was reached (its mini-batch pads it)."""
    grad: GradFn | None = field(default=None, repr=False)
    _scores: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def _pad_scores(self, m: int, a: np.ndarray) -> np.ndarray:
        if m not in self._scores:
            grad = self.grad(a, self.best_step[m]) if self.grad is not None else None
            self._scores[m] = taylor_scores(a, grad) if grad is not None else np.zeros(len(a))
        return self._scores[m]


def _evaluate(losses: LossFn, cands: np.ndarray, step: int, chunk: int) -> np.ndarray:
    out = []
    for s in range(0, len(cands), chunk):
        part = cands[s : s + chunk]
        v = np.asarray(losses(part, step), dtype=np.float64).reshape(-1)
        if len(v) != len(part):
            raise ValueError(f"losses callback returned {len(v)} values for {len(part)} candidates")
        out.append(v)
    return np.concatenate(out)


def greedy_global(
    losses: LossFn,
    grad: GradFn | None,
    n_channels: int,
    max_width: int,
    *,
    exact_until: int = 25,
    shortlist: int = 5,
    max_steps: int | None = None,
    chunk: int = 256,
) -> GlobalPath:
    """Greedy global imitation over the simplex of ``n_channels`` weights.

    ``losses(A, step)`` evaluates the discrepancy of the K candidate weight vectors in A (K, N),
    all on the same mini-batch for a given ``step`` (it is called with at most ``chunk`` rows at
    a time); ``grad(a, step)`` returns r = ∂D/∂b at b = 0 for the mask N·(a + b) (with
    ``grad=None`` every step is exact). Step 0 picks the best single neuron; step k >= 1
    moves to (1-γ)a + γ e_i, γ = 1/(k+1), with the best i among all N (k <= exact_until) or among
    the ``shortlist`` neurons with the smallest Taylor score gr_i (later steps). Stops once the
    support reaches ``max_width`` (or N), or after ``max_steps`` steps (default 3·max_width).
    """
    n = int(n_channels)
    if n < 1:
        raise ValueError(f"n_channels must be positive, got {n}")
    if not 1 <= max_width <= n:
        raise ValueError(f"max_width {max_width} outside [1, {n}]")
    if shortlist < 1:
        raise ValueError(f"shortlist must be positive, got {shortlist}")
    chunk = max(int(chunk), 1)
    max_steps = 3 * max_width if max_steps is None else int(max_steps)

    eye = np.eye(n)
    vals = _evaluate(losses, eye, 0, chunk)
    i0 = int(np.argmin(vals))
    evaluations = n
    counts = np.zeros(n, dtype=np.int64)
    counts[i0] = 1
    a = counts / 1.0
    cur = float(vals[i0])
    losses_, supports, picks, exact, order = [cur], [1], [i0], [True], [i0]
    curve = np.full(n + 1, np.inf)
    curve[1] = cur
    best = {1: a.copy()}
    best_step = {1: 0}
    support = 1

    step = 0
    while support < max_width and step < max_steps:
        step += 1
        total = step + 1  # Σ counts after this step; γ = 1/total
        if step <= exact_until or grad is None:
            idx = np.arange(n)
            is_exact = True
        else:
            r = np.asarray(grad(a, step), dtype=np.float64).reshape(-1)
            if len(r) != n:
                raise ValueError(f"grad callback returned {len(r)} values for {n} channels")
            idx = np.sort(np.argsort(taylor_scores(a, r), kind="stable")[: min(shortlist, n)])
            is_exact = False
        cands = np.repeat(counts[None, :].astype(np.float64), len(idx), axis=0)
        cands[np.arange(len(idx)), idx] += 1.0
        cands /= total
        vals = _evaluate(losses, cands, step, chunk)
        evaluations += len(idx)
        j = int(np.argmin(vals))
        i = int(idx[j])
        if counts[i] == 0:
            order.append(i)
            support += 1
        counts[i] += 1
        a = counts / float(total)
        cur = float(vals[j])
        losses_.append(cur)
        supports.append(support)
        picks.append(i)
        exact.append(is_exact)
        if cur < curve[support]:
            curve[support] = cur
            best[support] = a.copy()
            best_step[support] = step

    return GlobalPath(
        losses=np.array(losses_),
        supports=np.array(supports),
        picks=np.array(picks),
        exact=np.array(exact),
        curve=curve,
        order=np.array(order),
        final=a,
        evaluations=evaluations,
        best=best,
        best_step=best_step,
        grad=grad,
    )
