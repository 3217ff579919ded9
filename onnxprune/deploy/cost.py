"""Latency targets as the command line writes them; the cost table itself is ``onnxprune.cost``."""

from __future__ import annotations

import re

from onnxprune.cost import format_ms  # noqa: F401 (re-exported for the CLI)
from onnxprune.errors import TargetError


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
