"""Timing helpers of onnxruntime sessions: random feeds for any model's inputs, and alternating timed rounds."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from onnxprune.errors import OnnxPruneError
from onnxprune.ir.ort import InputSpec


# Seconds of back-to-back runs of one session per turn of ``time_rounds`` where a deployment is imitated:
# several turns per model against drift, few cold starts.
BLOCK_SECONDS = 0.05


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
    runs_of: Sequence[tuple[object, dict[str, np.ndarray]]], warmup: int, runs: int, min_seconds: float | None = None,
    block_seconds: float = 0.0, on_round: Callable[[int, int], None] | None = None,
) -> list[list[float]]:
    """Seconds of each timed ``session.run(None, feed)``, per (session, feed): ``warmup`` untimed runs
    each, then rounds in which every session takes a turn (so drift hits all alike), until each has at
    least ``runs`` timed runs and ``min_seconds`` have passed when given.

    A turn is one timed run, or with ``block_seconds`` > 0 a block: one untimed run (the caches the
    previous session filled settle), then as many timed runs as fill about ``block_seconds`` (at least
    one, at most ``runs``), so the timings see the session as it runs back to back, as a deployment does.
    ``on_round(done, runs)`` is called after each round with the fewest timed runs any session has."""
    blocks = []
    for session, feed in runs_of:
        for _ in range(warmup):
            session.run(None, feed)
        once = 0.0
        if block_seconds > 0:
            t0 = time.perf_counter()
            session.run(None, feed)
            once = time.perf_counter() - t0
        blocks.append(max(1, min(runs, int(block_seconds / once))) if once > 0 else 1)
    times: list[list[float]] = [[] for _ in runs_of]
    started = time.perf_counter()
    while (min(map(len, times), default=runs) < runs
           or (min_seconds is not None and time.perf_counter() - started < min_seconds)):
        for (session, feed), out, block in zip(runs_of, times, blocks):
            if block_seconds > 0:
                session.run(None, feed)
            for _ in range(block):
                t0 = time.perf_counter()
                session.run(None, feed)
                out.append(time.perf_counter() - t0)
        if on_round is not None:
            on_round(min(map(len, times)), runs)
    return times
