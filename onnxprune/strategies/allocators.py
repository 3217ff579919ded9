"""Allocators: how many channels each group keeps, spent on per-group curves within the budget."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from onnxprune.budget.allocation import CURVE_FLOOR, curve_widths, epsilon_widths, uniform_widths
from onnxprune.analysis.groups import Group
from onnxprune.core.context import Context, Progress
from onnxprune.budget.cost import Cost
from onnxprune.errors import OptionError
from onnxprune.strategies.base import Allocator
from onnxprune.strategies.sensitivity import output_curves


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
    measured on ``probe_samples`` others (``onnxprune.strategies.sensitivity``); the greedy then narrows where the
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
class Recoverable(Output):
    """``Output`` for a model ``recover`` will train: the probed discrepancy of the last ``late_share`` of the groups
    (in the network's order) weighs ``late_weight`` times, so the greedy narrows them less and the first groups more.
    ``recover`` mends the first blocks' error on photos of classes it never saw as much as on its training photos,
    the last blocks' (a few positions a photo for most of the weights) on its training photos only; measured on
    MobileNetV2 at 170M (``benchmarks/recovery_where.py``, ``recovery_allocation.py``; the notebook's "Where the
    unseen classes' error sits, and an allocation for `recover`")."""

    late_share: float = 1 / 3
    late_weight: float = 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.late_share <= 1 or not self.late_weight > 0:
            raise OptionError(f"Recoverable(late_share={self.late_share}, late_weight={self.late_weight}): the share "
                              "must lie in (0, 1] and the weight be positive", option="allocation")

    def curves(self, ctx: Context, order: list[tuple[int, Group]], on_layer: Progress | None
               ) -> tuple[dict[int, np.ndarray], dict[str, Any] | None]:
        curves, record = super().curves(ctx, order, on_layer)
        late = {g.id for _, g in order[len(order) - int(np.ceil(self.late_share * len(order))):]}
        return {k: c * self.late_weight if k in late else c for k, c in curves.items()}, record


@dataclass(frozen=True)
class Shared(Allocator):
    """``inner``'s widths on curves measured once and reused by every run given this same object, where the runs'
    groups are the same: the curves do not depend on the budget, so a sweep over budgets probes once."""

    inner: Allocator
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # group names in order -> curves, record

    @property
    def needs_curves(self) -> bool:  # type: ignore[override]
        return self.inner.needs_curves

    def curves(self, ctx: Context, order: list[tuple[int, Group]], on_layer: Progress | None
               ) -> tuple[dict[int, np.ndarray], dict[str, Any] | None]:
        key = tuple((cut, g.name, g.channels) for cut, g in order)
        if key not in self.cache:
            self.cache[key] = self.inner.curves(ctx, order, on_layer)
        curves, record = self.cache[key]
        return dict(curves), record  # a copy: the cache outlives the run

    def widths(self, cost: Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
               min_channels: int, round_to: int) -> dict[int, int]:
        return self.inner.widths(cost, groups, curves, target, min_channels, round_to)

    @property
    def floor(self) -> float:
        return self.inner.floor

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "shared": True}
