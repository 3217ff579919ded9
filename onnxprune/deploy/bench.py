"""Latency benchmark of ONNX models with onnxruntime on random inputs, and a comparison table."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from onnxprune.analysis import analyze
from onnxprune.errors import ModelError, OnnxPruneError
from onnxprune.ir.inputs import fix_input_shapes, resolve_input_shapes
from onnxprune.ir.load import load_model
from onnxprune.ir.ort import make_session, model_input_specs
from onnxprune.runtime.timing import BLOCK_SECONDS, random_inputs, time_rounds


@dataclass
class BenchResult:
    model: str
    provider: str  # the execution provider that really ran the model
    batch: int
    threads: int | None  # intra-op threads requested (None: onnxruntime's default)
    spin: bool  # intra-op threads busy-wait between the nodes of a run (onnxruntime's default) or sleep
    median_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    throughput: float  # samples per second over all timed runs
    runs: int  # timed runs
    macs: int | None  # per sample; None when the model cannot be analysed
    params: int | None

    def to_dict(self) -> dict:
        return asdict(self)


def _model_stats(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> tuple[int | None, int | None]:
    """(MACs per sample, parameters) at the benchmarked shapes; (None, None) if the analysis fails."""
    try:
        result = analyze(fix_input_shapes(model, shapes))
        return int(result.macs.total), int(result.params)
    except Exception:  # MACs/params are informational; a model the analysis cannot read still benchmarks
        return None, None


@dataclass
class _Target:
    """One model ready to time: its session, inputs and the timings so far."""

    path: Path
    model: onnx.ModelProto
    shapes: dict[str, list[int]]
    feed: dict[str, np.ndarray]
    session: object
    provider: str
    times: list[float] = field(default_factory=list)


def _prepare(
    path: Path, provider: str, batch: int, threads: int | None, spin: bool, input_shapes, seed: int
) -> _Target:
    model = load_model(path)
    specs = model_input_specs(model)
    if not specs:
        raise ModelError(f"{path}: the model has no inputs to feed: nothing to benchmark")
    shapes = resolve_input_shapes(specs, input_shapes, batch, str(path))
    session, active = make_session(path, provider, threads, spinning=spin, spin_between_runs=False)
    return _Target(path, model, shapes, random_inputs(specs, shapes, seed), session, active)


def _result(t: _Target, batch: int, threads: int | None, spin: bool) -> BenchResult:
    ms = np.asarray(t.times) * 1e3
    macs, params = _model_stats(t.model, t.shapes)
    total = float(sum(t.times))
    return BenchResult(
        model=str(t.path),
        provider=t.provider,
        batch=batch,
        threads=threads,
        spin=spin,
        median_ms=float(np.median(ms)),
        p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)),
        mean_ms=float(ms.mean()),
        throughput=float(batch * len(t.times) / total) if total > 0 else float("inf"),
        runs=len(t.times),
        macs=macs,
        params=params,
    )


def bench(model_path: str | Path, **kw) -> BenchResult:
    """Latency of ``model_path`` with onnxruntime on random inputs of the model's dtypes (see bench_many)."""
    return bench_many([model_path], **kw)[0]


def bench_many(
    paths: Iterable[str | Path],
    *,
    provider: str = "auto",
    batch: int = 1,
    threads: int | None = None,
    spin: bool = True,
    warmup: int = 10,
    runs: int = 50,
    min_seconds: float | None = None,
    input_shape: Mapping[str | None, Sequence[int]] | Iterable[str] | None = None,
    seed: int = 0,
    on_round: Callable[[int, int], None] | None = None,
) -> list[BenchResult]:
    """The latency of ``paths`` with onnxruntime on random inputs, timed in rounds (one block of back-to-back
    runs of each model per round, so a drifting machine affects all alike); ``onnxprune.bench``.

    Arguments:
        paths: ONNX model paths; the first is the baseline a table compares the others with.
        provider: 'auto' (the best available), 'cpu', 'cuda' or 'tensorrt'.
        batch: the batch size of the inputs.
        threads: onnxruntime's intra-op threads (default: onnxruntime's).
        spin: the threads busy-wait between the nodes of a run (onnxruntime's default, what a deployment
            runs with); False lets them sleep (a CPU shared with other work).
        warmup: untimed runs of each model first.
        runs: timed rounds, at least.
        min_seconds: go on with more rounds until this much time has passed.
        input_shape: shapes of the dynamic inputs (``["1x3x224x224"]`` or ``["name:1x3x320x320", ...]``).
        seed: seed of the random inputs.
        on_round: ``on_round(done, runs)`` after each round (timed runs of the model with the fewest so far).

    Returns one ``BenchResult`` per model (median/p90/p99/mean ms, throughput, MACs and parameters). A
    model's threads stop spinning when its run returns, and each of its blocks starts with an untimed run.
    Timed one run per model in turn, a session's spinning threads slowed the next one; with sleeping
    threads every node paid a wake-up, which weighs most on small models at batch 1; blocks time a model
    as it runs alone (``benchmarks/timing_modes.py``).
    """
    if batch < 1:
        raise OnnxPruneError(f"batch {batch} is invalid: use a batch size >= 1", option="batch")
    if threads is not None and threads < 1:
        raise OnnxPruneError(f"threads {threads} is invalid: use >= 1, or None for onnxruntime's default",
                             option="threads")
    if runs < 1 or warmup < 0:
        raise OnnxPruneError(f"runs {runs} / warmup {warmup} are invalid: use runs >= 1 and warmup >= 0",
                             option="runs" if runs < 1 else "warmup")
    targets = [_prepare(Path(p), provider, batch, threads, spin, input_shape, seed) for p in paths]
    times = time_rounds([(t.session, t.feed) for t in targets], warmup, runs, min_seconds, block_seconds=BLOCK_SECONDS,
                        on_round=on_round)
    for t, seconds in zip(targets, times):
        t.times = seconds
    return [_result(t, batch, threads, spin) for t in targets]
