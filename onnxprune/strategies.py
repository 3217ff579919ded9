"""Typed strategies of ``compress``: a budget, a channel selector, a width allocator and a reconstruction.

Each is a frozen dataclass checked when built; ``options_from`` turns one of each into the
``CompressOptions`` the pruning loop reads, so the library and the CLI resolve them in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from onnxprune.pipeline import TARGETS, CompressOptions
from onnxprune.errors import OptionError, check_choice


class Strategy:
    """A typed strategy: ``options()`` gives the ``CompressOptions`` fields it stands for."""

    def options(self) -> dict[str, Any]:
        raise NotImplementedError


class Budget(Strategy):
    """How small the pruned model must be."""


class Selector(Strategy):
    """Which channels each group keeps."""


class Allocator(Strategy):
    """How many channels each group keeps."""


class Reconstruction(Strategy):
    """How the consumers' weights are set after selection."""


@dataclass(frozen=True)
class MACs(Budget):
    """At most ``count`` multiply-accumulates per sample (Conv, ConvTranspose, Gemm, MatMul)."""

    count: float

    def __post_init__(self) -> None:
        if not self.count > 0:
            raise OptionError(f"MACs({self.count}): the MAC budget must be positive (--target-flops)")

    def options(self) -> dict[str, Any]:
        return {"target_macs": float(self.count)}


@dataclass(frozen=True)
class Ratio(Budget):
    """At most this fraction of the original's MACs, strictly between 0 and 1."""

    value: float

    def __post_init__(self) -> None:
        if not 0 < self.value < 1:
            raise OptionError(f"Ratio({self.value}): the MAC ratio must lie strictly between 0 and 1 (--target-ratio)")

    def options(self) -> dict[str, Any]:
        return {"target_ratio": self.value}


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
            raise OptionError("Latency needs exactly one of ms=... or ratio=... (--target-latency 3.5ms or 0.8x)")
        if self.ms is not None and not self.ms > 0:
            raise OptionError(f"Latency(ms={self.ms}) must be positive (--target-latency)")
        if self.ratio is not None and not 0 < self.ratio < 1:
            raise OptionError(f"Latency(ratio={self.ratio}) must lie strictly between 0 and 1 (--target-latency)")
        if self.batch < 1 or (self.threads is not None and self.threads < 1):
            raise OptionError(f"--latency-batch {self.batch} / --threads {self.threads} must be at least 1")

    def options(self) -> dict[str, Any]:
        return {"target_latency_ms": self.ms, "target_latency_ratio": self.ratio, "latency_batch": self.batch,
                "threads": self.threads, "cost_table": self.cost_table and str(self.cost_table),
                "save_cost_table": self.save_cost_table and str(self.save_cost_table)}


@dataclass(frozen=True)
class OMP(Selector):
    """Group orthogonal matching pursuit: greedy forward selection on the refitted consumers' output error."""

    def options(self) -> dict[str, Any]:
        return {"method": "omp"}


@dataclass(frozen=True)
class Local(Selector):
    """The paper's greedy local imitation towards the ``target``: 'original' (the original network's layer
    output) or 'paper' (the layer's own output on the pruned prefix)."""

    target: str = "original"

    def __post_init__(self) -> None:
        check_choice("target", self.target, TARGETS)

    def options(self) -> dict[str, Any]:
        return {"method": "local", "target": self.target}


@dataclass(frozen=True)
class Global(Selector):
    """The paper's greedy global imitation of the final output (slow without a GPU); ``seed`` of its draws."""

    seed: int = 0

    def options(self) -> dict[str, Any]:
        return {"method": "global", "seed": self.seed}


@dataclass(frozen=True)
class L1(Selector):
    """Baseline: the channels of largest producer-weight L1 norm."""

    def options(self) -> dict[str, Any]:
        return {"method": "l1"}


@dataclass(frozen=True)
class Random(Selector):
    """Baseline: channels drawn at random with ``seed``."""

    seed: int = 0

    def options(self) -> dict[str, Any]:
        return {"method": "random", "seed": self.seed}


@dataclass(frozen=True)
class Epsilon(Allocator):
    """One threshold on every layer's relative imitation loss (the paper's rule), searched to meet the budget."""

    def options(self) -> dict[str, Any]:
        return {"allocation": "epsilon"}


@dataclass(frozen=True)
class Uniform(Allocator):
    """The same keep ratio in every group."""

    def options(self) -> dict[str, Any]:
        return {"allocation": "uniform"}


@dataclass(frozen=True)
class Curve(Allocator):
    """Greedy on the per-layer error curves, each layer keeping at least 25%."""

    def options(self) -> dict[str, Any]:
        return {"allocation": "curve"}


@dataclass(frozen=True)
class NoRefit(Reconstruction):
    """Keep the consumers' weights, folding the selector's per-channel factors (the paper's N·a_i)."""

    def options(self) -> dict[str, Any]:
        return {"reconstruct": "none"}


@dataclass(frozen=True)
class Scale(Reconstruction):
    """A least-squares scale per kept channel, with relative ``ridge``."""

    ridge: float = 1e-4

    def __post_init__(self) -> None:
        if not self.ridge >= 0:
            raise OptionError(f"Scale(ridge={self.ridge}): the ridge must be at least 0")

    def options(self) -> dict[str, Any]:
        return {"reconstruct": "scale", "ridge": self.ridge}


@dataclass(frozen=True)
class Refit(Reconstruction):
    """A full least-squares refit of every consumer, its ridge chosen by cross-validation."""

    def options(self) -> dict[str, Any]:
        return {"reconstruct": "full"}


def _kind(value: object, kind: type[Strategy], name: str) -> Strategy:
    """``value`` itself if it is a ``kind``; else an OptionError naming the ``kind``s to choose from."""
    if not isinstance(value, kind):
        choices = ", ".join(f"{c.__name__}()" for c in _subclasses(kind))
        raise OptionError(f"{name}={value!r}: give one of {choices} (a {kind.__name__} of onnxprune.strategies)")
    return value


def _subclasses(kind: type) -> list[type]:
    return [c for c in kind.__subclasses__() if c.__module__ == __name__]


# The CompressOptions fields that the strategies set: ``options_from`` takes them from no other argument.
STRATEGY_FIELDS = frozenset({"target_macs", "target_ratio", "target_latency_ms", "target_latency_ratio",
                             "latency_batch", "threads", "cost_table", "save_cost_table", "method", "target",
                             "reconstruct", "allocation", "ridge", "seed"})


def options_from(budget: Budget, select: Selector = OMP(), allocate: Allocator = Epsilon(),
                 reconstruct: Reconstruction = Refit(), **rest: Any) -> CompressOptions:
    """The ``CompressOptions`` of one strategy of each kind; ``rest`` sets the other fields
    (``round_to``, ``batch_size``, ``provider``, ``best_effort``, ...)."""
    free = {f.name for f in fields(CompressOptions)} - STRATEGY_FIELDS
    unknown = sorted(set(rest) - free)
    if unknown:
        raise OptionError(f"compress option(s) {', '.join(unknown)} are not among {', '.join(sorted(free))}: "
                          "the budget and the strategies set the others")
    picked: dict[str, Any] = {}
    for value, kind, name in ((budget, Budget, "budget"), (select, Selector, "select"),
                              (allocate, Allocator, "allocate"), (reconstruct, Reconstruction, "reconstruct")):
        picked.update(_kind(value, kind, name).options())
    return CompressOptions(**rest, **picked)


SELECTORS: dict[str, type[Selector]] = {"omp": OMP, "local": Local, "global": Global, "l1": L1, "random": Random}
ALLOCATORS: dict[str, type[Allocator]] = {"epsilon": Epsilon, "uniform": Uniform, "curve": Curve}
RECONSTRUCTORS: dict[str, type[Reconstruction]] = {"full": Refit, "scale": Scale, "none": NoRefit}


def named(method: str, allocation: str, reconstruct: str, target: str = "original", seed: int = 0
          ) -> tuple[Selector, Allocator, Reconstruction]:
    """The strategies named as on the command line: ``target`` goes to ``Local``, ``seed`` to ``Random`` and
    ``Global``; an unknown name is an OptionError listing the valid ones."""
    check_choice("method", method, tuple(SELECTORS))
    check_choice("target", target, TARGETS)
    check_choice("allocation", allocation, tuple(ALLOCATORS))
    check_choice("reconstruct", reconstruct, tuple(RECONSTRUCTORS))
    kind = SELECTORS[method]
    select = kind(target) if kind is Local else kind(seed) if kind in (Random, Global) else kind()
    return select, ALLOCATORS[allocation](), RECONSTRUCTORS[reconstruct]()
