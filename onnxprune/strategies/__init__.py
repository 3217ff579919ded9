"""Typed strategies of ``compress``: a budget, a channel selector, a width allocator and a reconstruction.

Each is a frozen dataclass checked when built, and each carries the behaviour it stands for: the pruning
loop (``onnxprune.pipeline``) calls ``Budget.resolve``, ``Allocator.widths``, ``Selector.select`` and
``Reconstruction.apply`` and never compares a name. A strategy of one's own is a subclass implementing
that method (Torch-Pruning's habit of passing an importance object in). ``CompressOptions`` holds one of
each and the plain knobs; ``options_from`` and ``named`` build them as the API and the CLI do.

By kind: ``base`` (the four interfaces), ``budgets``, ``selectors`` (OMP, Local, L1, Random),
``global_search`` (global imitation) beside ``auto`` (its time-budget scheduler), ``allocators`` (with
``sensitivity``, the output allocation's probes), ``reconstructions``, and ``options``. The strategies reach
the run only through ``onnxprune.core.context.Context``, which the loop implements: nothing here imports the
loop.
"""

from onnxprune.strategies.allocators import Curve, Epsilon, Output, Recoverable, Shared, Uniform
from onnxprune.strategies.auto import DEFAULT_GLOBAL_BUDGET, Auto, TimeBudget
from onnxprune.strategies.base import Allocator, Budget, Reconstruction, Selector, Strategy
from onnxprune.strategies.budgets import Latency, MACs, Ratio
from onnxprune.strategies.global_search import Global, GlobalSearch
from onnxprune.strategies.options import (
    ALLOCATIONS, ALLOCATORS, METHODS, RECONSTRUCTIONS, RECONSTRUCTORS, SELECTORS, STRATEGY_KINDS, CompressOptions,
    named, options_from,
)
from onnxprune.strategies.reconstructions import NoRefit, Refit, Scale
from onnxprune.strategies.selectors import L1, OMP, TARGETS, Local, Random

__all__ = [
    "ALLOCATIONS", "ALLOCATORS", "DEFAULT_GLOBAL_BUDGET", "L1", "MACs", "METHODS", "OMP", "RECONSTRUCTIONS",
    "RECONSTRUCTORS", "SELECTORS", "STRATEGY_KINDS", "TARGETS", "Allocator", "Auto", "Budget", "CompressOptions",
    "Curve", "Epsilon", "Global", "GlobalSearch", "Latency", "Local", "NoRefit", "Output", "Random", "Ratio", "Shared",
    "Reconstruction", "Recoverable", "Refit", "Scale", "Selector", "Strategy", "TimeBudget", "Uniform", "named",
    "options_from",
]
