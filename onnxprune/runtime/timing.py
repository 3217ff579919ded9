"""Timing helpers of onnxruntime sessions: random feeds for any model's inputs, and alternating timed rounds."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from onnxprune.errors import OnnxPruneError
from onnxprune.runtime.ort import InputSpec


def random_inputs(
    specs: list[InputSpec], shapes: dict[str, list[int]], seed: int = 0
) -> dict[str, np.ndarray]:
    """Random arrays of each input's dtype and resolved shape (normal floats, 0/1 integers and bools)."""
    rng = np.random.default_rng(seed)
    feed = {}
    for name, _, dtype in specs:
        shape = shapes[name]
        if np.issubdtype(dtype, np.floating):
            feed[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feed[name] = rng.random(shape) < 0.5
        elif np.issubdtype(dtype, np.integer):
            feed[name] = rng.integers(0, 2, size=shape).astype(dtype)
        else:
            raise OnnxPruneError(f"input {name!r} has dtype {dtype}, for which no random data can be made: "
                                 "benchmark a model with numeric inputs")
    return feed


def time_rounds(
    runs_of: Sequence[tuple[object, dict[str, np.ndarray]]], warmup: int, runs: int, min_seconds: float | None = None
) -> list[list[float]]:
    """Seconds of each timed ``session.run(None, feed)``, per (session, feed): ``warmup`` untimed runs
    each, then rounds of one run per session (so drift hits all alike), at least ``runs`` rounds and
    until ``min_seconds`` have passed when given."""
    for session, feed in runs_of:
        for _ in range(warmup):
            session.run(None, feed)
    times: list[list[float]] = [[] for _ in runs_of]
    started = time.perf_counter()
    rounds = 0
    while rounds < runs or (min_seconds is not None and time.perf_counter() - started < min_seconds):
        for (session, feed), out in zip(runs_of, times):
            t0 = time.perf_counter()
            session.run(None, feed)
            out.append(time.perf_counter() - t0)
        rounds += 1
    return times
