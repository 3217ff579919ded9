"""Per-group widths that meet a budget: MACs, or latency predicted by a measured cost table.

Every allocation spends a ``Cost`` (``onnxprune.budget.cost``): the cost of the model for given group widths and
of the unpruned model. A ``MacModel`` is used as the MAC cost.
"""

from __future__ import annotations

import numpy as np

from onnxprune.analysis.groups import Group
from onnxprune.analysis.macs import MacModel
from onnxprune.budget.cost import Cost, as_cost, group_step
from onnxprune.errors import TargetError

CURVE_FLOOR = 0.25  # curve_widths never narrows a group below this share of its channels


def _floor(g: Group, min_channels: int, round_to: int) -> int:
    """The narrowest width of ``g``: ``min_channels``, at least one step, at most all channels."""
    return min(g.channels, max(min_channels, group_step(g.channels, round_to, g.unit)))


def lowest_macs(cost: MacModel | Cost, groups: list[Group], min_channels: int = 1, round_to: int = 1,
                share: float = 0.0) -> float:
    """The lowest cost (MACs, or what ``cost`` counts) of widths that keep at least ``share`` of each group
    (``CURVE_FLOOR`` for ``curve_widths``; what ``--best-effort`` prunes to)."""
    cost = as_cost(cost)
    if share:
        return cost(_curve_lowest(groups, min_channels, round_to, share))
    return cost({g.id: _floor(g, min_channels, round_to) for g in groups})


def check_target(cost: MacModel | Cost, groups: list[Group], target: float, min_channels: int,
                 round_to: int = 1, share: float = 0.0) -> None:
    """TargetError unless ``target`` lies between the lowest reachable cost (each group keeping at least
    ``share`` of its channels) and the original's."""
    cost = as_cost(cost)
    if target >= cost.total:
        raise TargetError(f"target {cost.show(target)} is not below the model's {cost.show(cost.total)}: "
                          "nothing to prune (lower the target)")
    floor = lowest_macs(cost, groups, min_channels, round_to, share)
    if target < floor:
        hint = (f"; rounding to {round_to} keeps at least {round_to} channels per group of {4 * round_to} or more"
                if round_to > 1 else "")
        if share:
            hint += f"; this allocation keeps at least {share:.0%} of each group (the uniform one goes lower)"
        units = sorted({g.unit for g in groups if g.unit > 1})
        if units:
            hint += (f"; a grouped convolution's channels count in whole conv groups ({', '.join(map(str, units))} "
                     "channels each), the least it keeps")
        raise TargetError(f"target {cost.show(target)} is unreachable: the prunable groups allow at "
                          f"least {cost.show(floor)} ({floor / cost.total:.1%} of the original){hint}; "
                          "best effort prunes to that instead", option="best_effort")


def _step(width: int, g: Group, round_to: int) -> int:
    """The next allowed width: the next multiple of the group's step, or all channels."""
    step = group_step(g.channels, round_to, g.unit)
    return min(g.channels, (width // step + 1) * step)


def fill(cost: MacModel | Cost, groups: list[Group], widths: dict[int, int], target: float,
         round_to: int = 1) -> dict[int, int]:
    """Spend the budget left by rounding: widen the relatively narrowest groups first (a removed block, at
    width 0, stays removed)."""
    cost = as_cost(cost)
    widths = dict(widths)
    while True:
        for g in sorted(groups, key=lambda g: (widths[g.id] / g.channels, g.id)):
            if 0 < widths[g.id] < g.channels:
                old = widths[g.id]
                widths[g.id] = _step(old, g, round_to)
                if cost(widths) <= target:
                    break
                widths[g.id] = old
        else:
            return widths


def uniform_widths(
    cost: MacModel | Cost, groups: list[Group], target: float, min_channels: int = 1, round_to: int = 1
) -> dict[int, int]:
    """The same keep ratio in every group (largest ratio within the budget), then ``fill``.

    Every width is a multiple of the group's step (``group_step``) or the full width."""
    cost = as_cost(cost)
    check_target(cost, groups, target, min_channels, round_to)

    def at(ratio: float) -> dict[int, int]:
        def width(g: Group) -> int:
            step = group_step(g.channels, round_to, g.unit)
            w = min(g.channels, max(_floor(g, min_channels, round_to), step * int(ratio * g.channels / step)))
            return w if w == g.channels or w % step == 0 else g.channels
        return {g.id: width(g) for g in groups}

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if cost(at(mid)) <= target:
            lo = mid
        else:
            hi = mid
    return fill(cost, groups, at(lo), target, round_to)


def _round_up(n: int, g: Group, round_to: int) -> int:
    step = group_step(g.channels, round_to, g.unit)
    return min(g.channels, -(-n // step) * step)


def epsilon_widths(
    cost: MacModel | Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
    min_channels: int = 1, round_to: int = 1,
) -> dict[int, int]:
    """The paper's rule: each group keeps the fewest channels whose relative imitation loss is ≤ ε,
    with one ε for all groups, searched so the total lands just under the budget, then ``fill``.

    ``curves[g][n]`` is the group's relative loss at width n (non-increasing in n)."""
    cost = as_cost(cost)
    check_target(cost, groups, target, min_channels, round_to)

    def at(eps: float) -> dict[int, int]:
        out = {}
        for g in groups:
            ok = np.flatnonzero(curves[g.id][1:] <= eps)
            n = int(ok[0]) + 1 if ok.size else g.channels
            out[g.id] = _round_up(max(n, _floor(g, min_channels, round_to)), g, round_to)
        return out

    lo, hi = -12.0, 1.0  # log10 ε: at hi every group sits at its floor
    for _ in range(60):
        mid = (lo + hi) / 2
        if cost(at(10**mid)) <= target:
            hi = mid
        else:
            lo = mid
    widths = at(10**hi)
    if cost(widths) > target:  # a loss above 10 (a layer whose mean output nearly cancels): go to the floor
        widths = at(np.inf)
    return fill(cost, groups, widths, target, round_to)


def curve_widths(
    cost: MacModel | Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
    min_channels: int = 1, round_to: int = 1, floor: float = CURVE_FLOOR,
) -> dict[int, int]:
    """Greedy on the error curves: repeatedly narrow the group whose next step costs the least
    relative loss per unit of cost saved, never below ``floor`` of its channels; a group whose curve is
    finite at width 0 (a removable block, probed) may also go to 0 in one step from any width."""
    cost = as_cost(cost)
    check_target(cost, groups, target, min_channels, round_to, floor)
    widths = {g.id: g.channels for g in groups}
    lowest = _curve_lowest(groups, min_channels, round_to, floor)
    unit = {g.id: group_step(g.channels, round_to, g.unit) for g in groups}
    step = {g.id: max(unit[g.id], unit[g.id] * int(np.ceil(0.01 * g.channels / unit[g.id]))) for g in groups}
    current = cost(widths)
    while current > target:
        best, best_price, best_cost = None, np.inf, current
        for g in groups:
            w = widths[g.id]
            moves = [max(lowest[g.id], w - step[g.id])] if w > lowest[g.id] else []
            moves += [0] if w and np.isfinite(curves[g.id][0]) else []
            for narrower in moves:
                trial = cost({**widths, g.id: narrower})
                price = (curves[g.id][narrower] - curves[g.id][w]) / max(current - trial, 1e-9)
                if price < best_price:
                    best, best_price, best_cost = (g.id, narrower), price, trial
        if best is None:
            raise TargetError(f"target {cost.show(target)} needs more than the floor of {floor:.0%} "
                              "of each group's channels allows: use the uniform allocation", option="allocation")
        widths[best[0]] = best[1]
        current = best_cost
    return fill(cost, groups, widths, target, round_to)


def _curve_lowest(groups: list[Group], min_channels: int, round_to: int, floor: float) -> dict[int, int]:
    """The narrowest widths ``curve_widths`` allows: ``floor`` of each group, at least ``min_channels``."""
    return {g.id: _round_up(max(_floor(g, min_channels, round_to), int(np.ceil(floor * g.channels))), g, round_to)
            for g in groups}
