"""What ``compress`` reports: per group and for the whole run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from onnxprune.budget.cost import LatencyReport


@dataclass
class LayerReport:
    group: str
    channels: int
    kept: int
    consumers: list[str]
    imitation_loss: float | None  # relative loss of the greedy's simplex solution (local only)
    error_fold: float  # relative output error of the consumers before the refit
    error: float  # relative output error of the consumers as written
    ridges: list[float]  # refit ridge per consumer, chosen by cross-validation (full reconstruction)
    seconds: float
    step: int  # widths were multiples of this: --round-to, or finer for a group narrower than 4 steps
    selection: dict | None = None  # what the selector noted: global/auto's method, discrepancies, why
    unit: int = 1  # channels per counted channel: a grouped conv's group (channels, kept and step count groups)
    units: str = "conv groups"  # what a counted channel is where unit > 1: conv groups, or heads


@dataclass
class CompressReport:
    macs_before: int
    macs_after: int
    params_before: int
    params_after: int
    target_macs: float  # the MAC budget (a latency budget: the MACs its widths come to)
    options: dict  # CompressOptions.to_dict()
    provider: str
    calibration_samples: int
    seconds: float = 0.0
    layers: list[LayerReport] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    requested_macs: float | None = None  # the budget asked for, when best_effort raised it to the lowest reachable
    latency: LatencyReport | None = None  # with a latency target (target_macs: the MACs its widths come to)
    fixed_batch: dict | None = None  # {"size", "reason"}: the graph fixes its batch, calibration ran at that batch
    written_batch: dict | None = None  # {"size", "reason"}: only the input fixes it; calibration batched, model kept it
    allocation: dict | None = None  # what the allocator measured: the output allocation's probes and their time
    selection: dict | None = None  # what the selector recorded of the run (auto: its global budget and spending)
    preflight: dict | None = None  # ``Preflight.to_dict()``: the groups pruned together in a copy, those excluded
    memory: dict | None = None  # ``MemoryPlan.to_dict()``: the plan, its estimate, what it lowered, the peak RSS
    objects: dict | None = None  # ``ObjectSamples``: a detector's calibration samples with objects, those kept

    def to_dict(self) -> dict:
        return asdict(self)
