"""Budgets: how small the pruned model must be (MACs, a ratio of them, or latency through a cost table)."""

from __future__ import annotations

import time
from dataclasses import dataclass


from onnxprune.analysis.groups import Group
from onnxprune.core.context import Context, Progress
from onnxprune.budget.cost import CostTable, LatencySpend, MacCost, MacSpend, Spend, measure_cost_table
from onnxprune.errors import OptionError
from onnxprune.ir.ort import first_provider
from onnxprune.strategies.base import Budget


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
