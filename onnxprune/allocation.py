"""Per-group widths that meet a MAC budget."""

from __future__ import annotations

import numpy as np

from onnxprune.analysis.groups import Group
from onnxprune.analysis.macs import MacModel
from onnxprune.errors import TargetError

CURVE_FLOOR = 0.25  # curve_widths never narrows a group below this share of its channels


def lowest_macs(macs: MacModel, groups: list[Group], min_channels: int = 1, round_to: int = 1,
                allocation: str = "epsilon") -> float:
    """The fewest MACs ``allocation``'s widths can reach (what ``--best-effort`` prunes to)."""
    min_channels = max(min_channels, round_to)
    if allocation == "curve":
        return macs.macs(_curve_lowest(groups, min_channels, round_to, CURVE_FLOOR))
    return macs.macs({g.id: min(min_channels, g.channels) for g in groups})


def check_target(macs: MacModel, groups: list[Group], target: float, min_channels: int, round_to: int = 1) -> None:
    """TargetError unless ``target`` lies between the lowest reachable MACs and the original."""
    if target >= macs.total:
        raise TargetError(f"target {target / 1e6:.3g}M MACs is not below the model's {macs.total / 1e6:.3g}M: "
                          "nothing to prune (lower --target-flops or --target-ratio)")
    floor = lowest_macs(macs, groups, min_channels)
    if target < floor:
        hint = f"; --round-to {round_to} keeps at least {round_to} channels per group" if round_to > 1 else ""
        raise TargetError(f"target {target / 1e6:.3g}M MACs is unreachable: the prunable groups allow at "
                          f"least {floor / 1e6:.3g}M ({floor / macs.total:.1%} of the original){hint}; "
                          "--best-effort prunes to that instead")


def _step(width: int, channels: int, round_to: int) -> int:
    """The next allowed width: the next multiple of ``round_to``, or all channels."""
    return min(channels, (width // round_to + 1) * round_to)


def fill(macs: MacModel, groups: list[Group], widths: dict[int, int], target: float, round_to: int = 1) -> dict[int, int]:
    """Spend the budget left by rounding: widen the relatively narrowest groups first."""
    widths = dict(widths)
    while True:
        for g in sorted(groups, key=lambda g: (widths[g.id] / g.channels, g.id)):
            if widths[g.id] < g.channels:
                old = widths[g.id]
                widths[g.id] = _step(old, g.channels, round_to)
                if macs.macs(widths) <= target:
                    break
                widths[g.id] = old
        else:
            return widths


def uniform_widths(
    macs: MacModel, groups: list[Group], target: float, min_channels: int = 1, round_to: int = 1
) -> dict[int, int]:
    """The same keep ratio in every group (largest ratio within the budget), then ``fill``.

    With ``round_to`` > 1 every width is a multiple of it (or the full width)."""
    min_channels = max(min_channels, round_to)
    check_target(macs, groups, target, min_channels, round_to)

    def at(ratio: float) -> dict[int, int]:
        def width(g: Group) -> int:
            w = min(g.channels, max(min_channels, round_to * int(ratio * g.channels / round_to)))
            return w if w == g.channels or w % round_to == 0 else g.channels
        return {g.id: width(g) for g in groups}

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if macs.macs(at(mid)) <= target:
            lo = mid
        else:
            hi = mid
    return fill(macs, groups, at(lo), target, round_to)


def _round_up(n: int, channels: int, round_to: int) -> int:
    return min(channels, -(-n // round_to) * round_to)


def epsilon_widths(
    macs: MacModel, groups: list[Group], curves: dict[int, np.ndarray], target: float,
    min_channels: int = 1, round_to: int = 1,
) -> dict[int, int]:
    """The paper's rule: each group keeps the fewest channels whose relative imitation loss is ≤ ε,
    with one ε for all groups, searched so the total lands just under the budget, then ``fill``.

    ``curves[g][n]`` is the group's relative loss at width n (non-increasing in n)."""
    min_channels = max(min_channels, round_to)
    check_target(macs, groups, target, min_channels, round_to)

    def at(eps: float) -> dict[int, int]:
        out = {}
        for g in groups:
            ok = np.flatnonzero(curves[g.id][1:] <= eps)
            n = int(ok[0]) + 1 if ok.size else g.channels
            out[g.id] = _round_up(max(n, min(min_channels, g.channels)), g.channels, round_to)
        return out

    lo, hi = -12.0, 1.0  # log10 ε: at hi every group sits at its floor
    for _ in range(60):
        mid = (lo + hi) / 2
        if macs.macs(at(10**mid)) <= target:
            hi = mid
        else:
            lo = mid
    widths = at(10**hi)
    if macs.macs(widths) > target:  # a loss above 10 (a layer whose mean output nearly cancels): go to the floor
        widths = at(np.inf)
    return fill(macs, groups, widths, target, round_to)


def curve_widths(
    macs: MacModel, groups: list[Group], curves: dict[int, np.ndarray], target: float,
    min_channels: int = 1, round_to: int = 1, floor: float = CURVE_FLOOR,
) -> dict[int, int]:
    """Greedy on the error curves: repeatedly narrow the group whose next step costs the least
    relative loss per MAC saved, never below ``floor`` of its channels."""
    min_channels = max(min_channels, round_to)
    check_target(macs, groups, target, min_channels, round_to)
    widths = {g.id: g.channels for g in groups}
    lowest = _curve_lowest(groups, min_channels, round_to, floor)
    step = {g.id: max(round_to, round_to * int(np.ceil(0.01 * g.channels / round_to))) for g in groups}
    current = macs.macs(widths)
    while current > target:
        best, best_cost, best_macs = None, np.inf, current
        for g in groups:
            w = widths[g.id]
            if w <= lowest[g.id]:
                continue
            narrower = max(lowest[g.id], w - step[g.id])
            trial = macs.macs({**widths, g.id: narrower})
            cost = (curves[g.id][narrower] - curves[g.id][w]) / max(current - trial, 1e-9)
            if cost < best_cost:
                best, best_cost, best_macs = (g.id, narrower), cost, trial
        if best is None:
            raise TargetError(f"target {target / 1e6:.1f}M MACs needs more than the floor of {floor:.0%} "
                              "of each group's channels allows: use --allocation uniform")
        widths[best[0]] = best[1]
        current = best_macs
    return fill(macs, groups, widths, target, round_to)


def _curve_lowest(groups: list[Group], min_channels: int, round_to: int, floor: float) -> dict[int, int]:
    """The narrowest widths ``curve_widths`` allows: ``floor`` of each group, at least ``min_channels``."""
    return {g.id: _round_up(max(min_channels, int(np.ceil(floor * g.channels))), g.channels, round_to)
            for g in groups}
