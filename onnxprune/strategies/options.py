"""``CompressOptions`` (one strategy of each kind and the plain knobs, checked when built) and the strategies named
as on the command line."""

from __future__ import annotations

from dataclasses import dataclass, fields
from numbers import Integral
from typing import Any


from onnxprune.errors import OptionError, check_choice
from onnxprune.ir.ort import PROVIDER_CHAINS
from onnxprune.ir.store import check_memory
from onnxprune.strategies.allocators import Curve, Epsilon, Output, Recoverable, Uniform
from onnxprune.strategies.auto import DEFAULT_GLOBAL_BUDGET, Auto
from onnxprune.strategies.base import Allocator, Budget, Reconstruction, Selector, Strategy
from onnxprune.strategies.budgets import Latency, MACs, Ratio
from onnxprune.strategies.global_search import Global
from onnxprune.strategies.reconstructions import NoRefit, Refit, Scale
from onnxprune.strategies.selectors import L1, OMP, TARGETS, Local, Random
from onnxprune.tasks import TASKS


def _kind(value: object, kind: type[Strategy], name: str) -> Strategy:
    """``value`` itself if it is a ``kind``; else an OptionError naming the ``kind``s to choose from."""
    if not isinstance(value, kind):
        choices = ", ".join(f"{c.__name__}()" for c in CHOICES[kind])
        raise OptionError(f"{name}={value!r}: give one of {choices} (a {kind.__name__} of onnxprune.strategies)")
    return value


@dataclass
class CompressOptions:
    """What to prune and how: one strategy of each kind (checked to be one) and the plain knobs."""

    budget: Budget
    select: Selector = OMP()
    allocate: Allocator = Output()
    reconstruct: Reconstruction = Refit()
    min_channels: int = 1
    round_to: int = 8
    curve_samples: int = 128  # calibration samples (evenly spaced) for the allocation's error curves
    batch_size: int = 32
    provider: str = "auto"
    best_effort: bool = False  # a budget below the lowest reachable MACs prunes to those instead of failing
    residual_streams: bool = False  # also prune the channels that residual Adds sum across blocks, jointly
    empty_samples: bool = False  # a detector fits on every calibration sample, not only those showing an object
    memory: int | None = None  # bytes of cached activations held in RAM, the rest spilled to disk (None: half
    # of the memory available when compress starts)
    spill_dir: str | None = None  # where spilled activations go (None: the system's temporary folder)
    task: str = "auto"  # how the output allocation reads the outputs (``onnxprune.tasks``): "raw" for plain L2

    def __post_init__(self) -> None:
        for name, kind in STRATEGY_KINDS.items():
            _kind(getattr(self, name), kind, name)
        check_memory(self.memory)
        for name in ("min_channels", "round_to", "curve_samples", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 1:
                raise OptionError(f"{name}={value!r}: a whole number of at least 1 (--{name.replace('_', '-')})")
        check_choice("provider", self.provider, ("auto", *PROVIDER_CHAINS))
        check_choice("task", self.task, TASKS)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: each strategy as its ``describe()`` ({"kind": "OMP", ...}), the knobs as they are."""
        return {f.name: getattr(self, f.name).describe() if f.name in STRATEGY_KINDS else getattr(self, f.name)
                for f in fields(self)}


STRATEGY_KINDS: dict[str, type[Strategy]] = {"budget": Budget, "select": Selector, "allocate": Allocator,
                                             "reconstruct": Reconstruction}


def options_from(budget: Budget, select: Selector = OMP(), allocate: Allocator = Output(),
                 reconstruct: Reconstruction = Refit(), **rest: Any) -> CompressOptions:
    """The ``CompressOptions`` of one strategy of each kind; ``rest`` sets the other fields
    (``round_to``, ``batch_size``, ``provider``, ``best_effort``, ...)."""
    free = {f.name for f in fields(CompressOptions)} - set(STRATEGY_KINDS)
    unknown = sorted(set(rest) - free)
    if unknown:
        raise OptionError(f"compress option(s) {', '.join(unknown)} are not among {', '.join(sorted(free))}: "
                          "the budget and the strategies set the others")
    return CompressOptions(budget, select, allocate, reconstruct, **rest)


SELECTORS: dict[str, type[Selector]] = {"omp": OMP, "local": Local, "global": Global, "auto": Auto, "l1": L1,
                                        "random": Random}


ALLOCATORS: dict[str, type[Allocator]] = {"epsilon": Epsilon, "uniform": Uniform, "curve": Curve, "output": Output,
                                          "recover": Recoverable}


RECONSTRUCTORS: dict[str, type[Reconstruction]] = {"refit": Refit, "scale": Scale, "none": NoRefit}  # the API's words
METHODS, ALLOCATIONS, RECONSTRUCTIONS = tuple(SELECTORS), tuple(ALLOCATORS), tuple(RECONSTRUCTORS)
# the strategies of each kind that onnxprune provides, as a wrong value's error lists them
CHOICES: dict[type[Strategy], tuple[type[Strategy], ...]] = {
    Budget: (MACs, Ratio, Latency), Selector: tuple(SELECTORS.values()), Allocator: tuple(ALLOCATORS.values()),
    Reconstruction: (NoRefit, Scale, Refit)}


def named(method: str, allocation: str, reconstruct: str, target: str = "original", seed: int = 0,
          remove_blocks: bool = False, global_budget: float | None = None) -> tuple[Selector, Allocator, Reconstruction]:
    """The strategies named as on the command line: ``target`` goes to ``Local``, ``seed`` to ``Random``, ``Global``
    and ``Auto``, ``global_budget`` to ``Auto``, ``remove_blocks`` to ``Output`` (or ``Recoverable``); an unknown name
    is an OptionError listing the valid ones."""
    check_choice("method", method, METHODS)
    check_choice("target", target, TARGETS)
    check_choice("allocation", allocation, ALLOCATIONS)
    if reconstruct == "full":
        raise OptionError("--reconstruct full is now called 'refit', as the API's Refit(): use --reconstruct refit",
                          option="reconstruct")
    check_choice("reconstruct", reconstruct, RECONSTRUCTIONS)
    if remove_blocks and not issubclass(ALLOCATORS[allocation], Output):
        raise OptionError(f"block removal is chosen by the output allocation, not by {allocation}: use "
                          "--allocation output or recover with --remove-blocks", option="remove_blocks")
    if global_budget is not None and SELECTORS[method] is not Auto:
        raise OptionError(f"the global budget is auto's, not {method}'s: use --method auto with --global-budget",
                          option="global_budget")
    kind = SELECTORS[method]
    if kind is Auto:
        select = Auto(seed=seed, budget=DEFAULT_GLOBAL_BUDGET if global_budget is None else global_budget)
    else:
        select = kind(target) if kind is Local else kind(seed) if kind in (Random, Global) else kind()
    allocate = ALLOCATORS[allocation](remove_blocks=True) if remove_blocks else ALLOCATORS[allocation]()
    return select, allocate, RECONSTRUCTORS[reconstruct]()
