"""The four kinds of strategy and what the pruning loop calls on each."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from typing import Any

import numpy as np

from onnxprune.budget.allocation import lowest_macs
from onnxprune.analysis.groups import Group
from onnxprune.core.context import Choice, ConsumerData, Context, Progress
from onnxprune.core.statistics import error_curves
from onnxprune.budget.cost import Cost, Spend


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
        return (error_curves(ctx, order, on_layer) if self.needs_curves else {}), None

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
