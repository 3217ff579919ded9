"""Per-group widths that meet a MAC budget."""

from __future__ import annotations

from onnxprune.analysis.groups import Group
from onnxprune.analysis.macs import MacModel
from onnxprune.errors import TargetError


def check_target(macs: MacModel, groups: list[Group], target: float, min_channels: int) -> None:
    """TargetError unless ``target`` lies between the lowest reachable MACs and the original."""
    if target >= macs.total:
        raise TargetError(f"target {target / 1e6:.1f}M MACs is not below the model's {macs.total / 1e6:.1f}M: "
                          "nothing to prune (lower --target-flops or --target-ratio)")
    floor = macs.macs({g.id: min(min_channels, g.channels) for g in groups})
    if target < floor:
        raise TargetError(f"target {target / 1e6:.1f}M MACs is unreachable: the prunable groups allow at "
                          f"least {floor / 1e6:.1f}M ({floor / macs.total:.1%} of the original)")


def fill(macs: MacModel, groups: list[Group], widths: dict[int, int], target: float) -> dict[int, int]:
    """Spend the budget left by rounding: add channels to the relatively narrowest groups first."""
    widths = dict(widths)
    while True:
        for g in sorted(groups, key=lambda g: (widths[g.id] / g.channels, g.id)):
            if widths[g.id] < g.channels:
                widths[g.id] += 1
                if macs.macs(widths) <= target:
                    break
                widths[g.id] -= 1
        else:
            return widths


def uniform_widths(macs: MacModel, groups: list[Group], target: float, min_channels: int = 1) -> dict[int, int]:
    """The same keep ratio in every group (largest ratio within the budget), then ``fill``."""
    check_target(macs, groups, target, min_channels)

    def at(ratio: float) -> dict[int, int]:
        return {g.id: max(min(min_channels, g.channels), min(g.channels, round(ratio * g.channels))) for g in groups}

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if macs.macs(at(mid)) <= target:
            lo = mid
        else:
            hi = mid
    return fill(macs, groups, at(lo), target)
