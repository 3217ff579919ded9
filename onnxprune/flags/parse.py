"""Flag values written as text: MAC counts, latencies, a sweep's targets, durations, lists of numbers."""

from __future__ import annotations

import re

from onnxprune.errors import OnnxPruneError, TargetError
from onnxprune.strategies import Budget, Latency, MACs, Ratio


def parse_macs(text: str) -> float:
    """A MAC count as written on the command line: '245M' → 245e6, '2.2G' → 2.2e9, '300000' → 3e5."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise TargetError(f"cannot read {text!r} as a MAC count: write e.g. 245M, 2.2G or 300000000")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    return float(match.group(1)) * scale


def parse_latency(text: str) -> tuple[float | None, float | None]:
    """'3.5ms' → (3.5, None), '800us' → (0.8, None), '0.8x' → (None, 0.8): milliseconds or a ratio of the
    original's measured latency."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|us|µs|s|x)\s*", text.lower())
    if not match:
        raise TargetError(f"cannot read {text!r} as a latency: write e.g. 3.5ms, 800us, or 0.8x (a fraction of "
                          "the original model's measured latency)")
    value, unit = float(match.group(1)), match.group(2)
    if unit == "x":
        if not 0 < value < 1:
            raise TargetError(f"latency {text}: a ratio must lie strictly between 0 and 1 (e.g. 0.8x)",
                              option="target_latency")
        return None, value
    if value <= 0:
        raise TargetError(f"latency {text} must be positive", option="target_latency")
    return value * {"ms": 1.0, "us": 1e-3, "µs": 1e-3, "s": 1e3}[unit], None


def parse_target(text: str) -> tuple[str, Budget]:
    """A sweep's budget, labelled, as compress's target flags take it: a MAC ratio ('0.8', --target-ratio), MACs
    ('245M', --target-flops) or a latency ('3.5ms', '0.8x', --target-latency)."""
    label = text.strip()
    if re.fullmatch(r"[0-9]*\.[0-9]+", label) and 0 < float(label) < 1:
        return label, Ratio(float(label))
    try:
        if re.search(r"(ms|us|µs|s|x)$", label.lower()):
            return label, Latency(*parse_latency(label))
        return label, MACs(parse_macs(label))
    except TargetError as exc:
        raise TargetError(f"target {text!r} is not a MAC ratio (0.8), MACs (245M) or a latency (3.5ms, 0.8x): {exc}",
                          option="targets") from None


def parse_duration(text: str | None) -> float | None:
    """Seconds of '900', '900s', '15m' or '1.5h' (None stays None)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([smh]?)\s*", text)
    if m is None:
        raise OnnxPruneError(f"time {text!r} is not a duration: 900, 900s, 15m or 1.5h", option="time")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def numbers(text: str) -> tuple[float, ...]:
    """``"0.485,0.456,0.406"`` → a tuple of floats (--mean, --std)."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise OnnxPruneError(f"cannot read {text!r} as comma-separated numbers (e.g. 0.485,0.456,0.406)") from None
