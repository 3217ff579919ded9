"""Shortlisted global imitation with refitted consumers (``shortlisted_global``, what ``--method global`` and
``auto`` run).

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

The paper's own global imitation (simplex weights folded as N·aᵢ, exact steps then a Taylor shortlist) is
research code outside the product: ``benchmarks/paper_global.py``, for the benchmarks that redo its figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from onnxprune.imitation.omp import ChannelOrder

__all__ = ["ShortlistPath", "evaluations", "lu_flops", "plan", "shortlisted_global", "solve_flops"]


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


