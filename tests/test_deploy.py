"""Deployment: onnxruntime benchmark, TensorRT-ready export, trtexec line (CPU only, no timing thresholds)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

import onnxprune.deploy.bench as bench_module
import onnxprune.runtime.timing as timing
from onnxprune.tables import format_bench_table
from onnxprune.deploy.bench import BenchResult, bench, bench_many
from onnxprune.ir.inputs import parse_input_shapes
from onnxprune.deploy.export import TensorRTUnavailable, build_engine, prepare_for_tensorrt, trtexec_command
from onnxprune.errors import ModelError, OnnxPruneError, OutputError, UnsupportedOpError
from tests.test_benchmarks import DATA, ROOT, needs_real_model

HAVE_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def _classifier(path: Path, channels: int = 4, dims: tuple = ("N", 3, 8, 8), seed: int = 0) -> Path:
    """Conv -> Relu -> GlobalAveragePool -> Reshape([N, -1] computed with Shape/Gather) -> Gemm, dynamic batch."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((channels, 3, 3, 3)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "b")
    fc = numpy_helper.from_array(rng.standard_normal((5, channels)).astype(np.float32), "fc")
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    minus1 = numpy_helper.from_array(np.array([-1], np.int64), "minus1")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0, name="gather"),
        helper.make_node("Concat", ["n", "minus1"], ["target"], axis=0, name="concat"),
        helper.make_node("Reshape", ["g", "target"], ["flat"], name="reshape"),
        helper.make_node("Gemm", ["flat", "fc"], ["y"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(dims))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])],
        [w, b, fc, zero, minus1],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return _classifier(tmp_path / "tiny.onnx")


def _static(value: onnx.ValueInfoProto) -> list[int] | None:
    dims = value.type.tensor_type.shape.dim
    return [d.dim_value for d in dims] if all(d.HasField("dim_value") for d in dims) else None


# ---------------------------------------------------------------- parse_input_shapes


def test_parse_input_shapes_forms() -> None:
    assert parse_input_shapes(["1x3x224x224"]) == {None: [1, 3, 224, 224]}
    assert parse_input_shapes(["images:1x3x320x320", "im_info:1x3"]) == {"images": [1, 3, 320, 320], "im_info": [1, 3]}
    assert parse_input_shapes([]) == {}
    assert parse_input_shapes(None) == {}


@pytest.mark.parametrize("spec", ["1x3xHx224", "abc", ":1x3", "x:", "1x0x2", "1x3x", "images=1x3x8x8"])
def test_parse_input_shapes_rejects_bad_text(spec: str) -> None:
    with pytest.raises(OnnxPruneError) as e:
        parse_input_shapes([spec])
    assert spec in str(e.value)
    if "0" not in spec.split("x"):
        assert "NAME:NxCxHxW" in str(e.value) and "1x3x224x224" in str(e.value)


def test_parse_input_shapes_rejects_duplicates_and_mixing() -> None:
    with pytest.raises(OnnxPruneError, match="twice"):
        parse_input_shapes(["a:1x2", "a:1x3"])
    with pytest.raises(OnnxPruneError, match="name each"):
        parse_input_shapes(["1x2", "a:1x3"])


# ---------------------------------------------------------------- bench


def test_bench_result_fields(tiny: Path) -> None:
    r = bench(tiny, provider="cpu", batch=3, threads=1, warmup=2, runs=7)
    assert isinstance(r, BenchResult)
    assert r.model == str(tiny)
    assert r.provider == "CPUExecutionProvider"
    assert (r.batch, r.threads, r.runs) == (3, 1, 7)
    assert 0 < r.median_ms <= r.p90_ms <= r.p99_ms
    assert r.mean_ms > 0 and r.throughput > 0
    # MACs per sample: Conv 4*8*8 outputs x 3*3*3 + Gemm 5 x 4; params: w, b, fc.
    assert r.macs == 4 * 8 * 8 * 27 + 5 * 4
    assert r.params == 4 * 27 + 4 + 5 * 4
    d = r.to_dict()
    assert d["provider"] == "CPUExecutionProvider" and d["batch"] == 3 and set(d) >= {"median_ms", "p99_ms", "macs"}


def _config(session: ort.InferenceSession, key: str) -> str | None:
    try:
        return session.get_session_options().get_session_config_entry(key)
    except RuntimeError:  # onnxruntime raises for a key that was never set
        return None


@pytest.mark.parametrize("spin", [True, False])
def test_bench_honours_batch_threads_spin_and_min_seconds(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                          spin: bool) -> None:
    """Spinning threads (onnxruntime's default) stop when a run returns, so they cannot steal the next model's
    cores; --no-spin lets them sleep between nodes too."""
    seen = {}
    real = bench_module.make_session

    def spy(model, provider, threads, **kw):
        session, active = real(model, provider, threads, **kw)
        seen["threads"] = session.get_session_options().intra_op_num_threads
        seen["spinning"] = _config(session, "session.intra_op.allow_spinning")
        seen["stop"] = _config(session, "session.force_spinning_stop")
        real_run = session.run

        class Wrapped:
            def run(self, names, feed):
                seen["shape"] = feed["x"].shape
                seen["dtype"] = feed["x"].dtype
                return real_run(names, feed)

        return Wrapped(), active

    monkeypatch.setattr(bench_module, "make_session", spy)
    r = bench(tiny, provider="auto", batch=4, threads=2, spin=spin, warmup=0, runs=1, min_seconds=0.05)
    expect = {"spinning": None, "stop": "1"} if spin else {"spinning": "0", "stop": None}
    assert seen == {"threads": 2, **expect, "shape": (4, 3, 8, 8), "dtype": np.float32}
    assert r.runs >= 1 and r.batch == 4 and r.threads == 2 and r.spin is spin
    assert r.provider == "CPUExecutionProvider"  # auto on a CPU-only onnxruntime


def test_time_rounds_blocks_of_back_to_back_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With blocks, each turn is one untimed run then the runs that fill block_seconds (by the probe run's time),
    at most ``runs``; rounds go on until every session has ``runs`` timed runs."""
    clock = [0.0]
    log: list[str] = []

    class Fake:
        def __init__(self, name: str, seconds: float) -> None:
            self.name, self.seconds = name, seconds

        def run(self, names, feed) -> None:
            log.append(self.name)
            clock[0] += self.seconds

    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    a, b = Fake("a", 1.0), Fake("b", 2.5)  # exact in binary: 5 / 2.5 is 2, not 1.999
    times = timing.time_rounds([(a, {}), (b, {}), ], warmup=1, runs=6, block_seconds=5.0)
    # a: 5 runs fill 5 s, b: 2; b needs 3 rounds for 6 runs, so a gets 15
    assert [len(t) for t in times] == [15, 6]
    assert times[0] == [1.0] * 15 and times[1] == [2.5] * 6
    turn = ["a"] * 6 + ["b"] * 3  # the untimed settling run, then the block
    assert log == ["a", "a", "b", "b"] + turn * 3  # warm-up and probe run per session first
    log.clear()
    assert [len(t) for t in timing.time_rounds([(a, {}), (b, {})], warmup=0, runs=3, block_seconds=100.0)] == [3, 3]
    log.clear()
    assert [len(t) for t in timing.time_rounds([(a, {}), (b, {})], warmup=0, runs=2)] == [2, 2]
    assert log == ["a", "b", "a", "b"]  # no blocks: one timed run per turn, nothing untimed


def test_bench_many_table_has_speedup_and_mac_ratio(tmp_path: Path) -> None:
    a = _classifier(tmp_path / "base.onnx", channels=8)
    b = _classifier(tmp_path / "pruned.onnx", channels=4)
    results = bench_many([a, b], provider="cpu", warmup=1, runs=3)
    assert [r.model for r in results] == [str(a), str(b)]
    table = format_bench_table(results)
    headers = [c.header for c in table.columns]
    assert headers == ["model", "provider", "batch", "median ms", "p90 ms", "p99 ms", "throughput /s", "MACs",
                       "params", "speed-up", "MAC ratio"]
    speedup = list(table.columns[headers.index("speed-up")].cells)
    ratio = list(table.columns[headers.index("MAC ratio")].cells)
    assert speedup[0] == "1.00x" and speedup[1] == f"{results[0].median_ms / results[1].median_ms:.2f}x"
    assert ratio[0] == "1.000" and ratio[1] == f"{results[1].macs / results[0].macs:.3f}"
    assert 0.4 < results[1].macs / results[0].macs < 0.6
    console = Console(record=True, width=200)
    console.print(table)
    assert "pruned.onnx" in console.export_text()


def test_bench_many_times_models_in_alternating_blocks(tmp_path: Path, monkeypatch) -> None:
    """Models take turns (drift of the machine's speed hits every model alike), each turn an untimed run then a
    block of back-to-back timed runs."""
    import onnxprune.deploy.bench as bench_mod

    calls: list[str] = []
    real = bench_mod.make_session

    def recording(path, provider, threads, **kw):
        session, active = real(path, provider, threads, **kw)

        class Recorder:
            def run(self, names, feed):
                calls.append(Path(path).stem)
                return session.run(names, feed)

        return Recorder(), active

    monkeypatch.setattr(bench_mod, "make_session", recording)
    a = _classifier(tmp_path / "base.onnx", channels=8)
    b = _classifier(tmp_path / "pruned.onnx", channels=4)
    results = bench_many([a, b], provider="cpu", warmup=0, runs=3)
    # the probe run of each sets its block (50 ms of these tiny models: capped at runs)
    assert calls == ["base", "pruned"] + ["base"] * 4 + ["pruned"] * 4
    assert [r.runs for r in results] == [3, 3]
    calls.clear()
    monkeypatch.setattr(bench_mod, "BLOCK_SECONDS", 1e-9)  # a block of one run per turn
    results = bench_many([a, b], provider="cpu", warmup=0, runs=3)
    assert calls == ["base", "pruned"] + ["base", "base", "pruned", "pruned"] * 3
    assert [r.runs for r in results] == [3, 3]


def test_bench_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="nope.onnx"):
        bench(tmp_path / "nope.onnx", provider="cpu")


def test_bench_dynamic_spatial_dims_need_input_shape(tmp_path: Path) -> None:
    path = _classifier(tmp_path / "dyn.onnx", dims=("N", 3, "H", "W"))
    with pytest.raises(OnnxPruneError) as e:
        bench(path, provider="cpu", runs=1, warmup=0)
    msg = str(e.value)
    assert "input shape" in msg and "'x'" in msg and "dim 2" in msg and "dyn.onnx" in msg
    r = bench(path, provider="cpu", batch=2, runs=2, warmup=0, input_shape=["x:2x3x16x16"])
    assert r.macs == 4 * 16 * 16 * 27 + 5 * 4
    r = bench(path, provider="cpu", batch=1, runs=1, warmup=0, input_shape=parse_input_shapes(["1x3x8x8"]))
    assert r.batch == 1


def test_bench_shape_conflicts(tmp_path: Path, tiny: Path) -> None:
    static = _classifier(tmp_path / "static.onnx", dims=(2, 3, 8, 8))
    with pytest.raises(OnnxPruneError, match="static batch size of 2 but the batch is 4"):
        bench(static, provider="cpu", batch=4)
    assert bench(static, provider="cpu", batch=2, runs=1, warmup=0).batch == 2
    with pytest.raises(OnnxPruneError, match="batch"):
        bench(tiny, provider="cpu", batch=1, input_shape=["4x3x8x8"])
    with pytest.raises(OnnxPruneError, match="fixes it to 8"):
        bench(tiny, provider="cpu", input_shape=["1x3x9x9"])
    with pytest.raises(OnnxPruneError, match="does not have"):
        bench(tiny, provider="cpu", input_shape=["images:1x3x8x8"])
    with pytest.raises(OnnxPruneError, match="4 dims"):
        bench(tiny, provider="cpu", input_shape=["1x3x8"])


def test_bench_unknown_provider(tiny: Path) -> None:
    with pytest.raises(OnnxPruneError) as e:
        bench(tiny, provider="gpu")
    assert "'gpu'" in str(e.value) and "cpu" in str(e.value) and "cuda" in str(e.value) and "tensorrt" in str(e.value)


def test_bench_rejects_bad_numbers(tiny: Path) -> None:
    with pytest.raises(OnnxPruneError, match="batch 0 is invalid"):
        bench(tiny, batch=0)
    with pytest.raises(OnnxPruneError, match="threads"):
        bench(tiny, threads=0)


# ---------------------------------------------------------------- TensorRT export


def test_prepare_for_tensorrt_static_and_equivalent(tiny: Path, tmp_path: Path) -> None:
    out = prepare_for_tensorrt(tiny, tmp_path / "trt.onnx")
    assert out == tmp_path / "trt.onnx" and out.is_file()
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    assert [_static(v) for v in model.graph.input] == [[1, 3, 8, 8]]
    assert [_static(v) for v in model.graph.output] == [[1, 5]]
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"Shape", "Gather", "Concat"}, ops  # the batch-size arithmetic is folded away
    assert not list(tmp_path.glob(".*.tmp"))

    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    ref = ort.InferenceSession(str(tiny), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_prepare_for_tensorrt_input_shapes(tmp_path: Path) -> None:
    path = _classifier(tmp_path / "dyn.onnx", dims=("N", 3, "H", "W"))
    with pytest.raises(OnnxPruneError, match="input shape"):
        prepare_for_tensorrt(path, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()
    out = prepare_for_tensorrt(path, tmp_path / "out.onnx", input_shapes=["x:2x3x16x16"])
    model = onnx.load(str(out))
    assert [_static(v) for v in model.graph.input] == [[2, 3, 16, 16]]
    assert [_static(v) for v in model.graph.output] == [[2, 5]]
    x = np.random.default_rng(2).standard_normal((2, 3, 16, 16)).astype(np.float32)
    ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_prepare_for_tensorrt_refuses_input_path_and_missing(tiny: Path, tmp_path: Path) -> None:
    before = tiny.read_bytes()
    with pytest.raises(OutputError):
        prepare_for_tensorrt(tiny, tiny)
    assert tiny.read_bytes() == before
    with pytest.raises(ModelError):
        prepare_for_tensorrt(tmp_path / "nope.onnx", tmp_path / "out.onnx")


def test_prepare_for_tensorrt_reports_unsupported_ops(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["d"], name="det"), helper.make_node("Relu", ["d"], ["y"], name="relu")],
        "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N"])],
    )
    path = tmp_path / "det.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(UnsupportedOpError, match=r"Det \(x1\)"):
        prepare_for_tensorrt(path, tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_trtexec_command() -> None:
    assert trtexec_command("m.onnx", "m.engine", False, 1024, None) == (
        "trtexec --onnx=m.onnx --saveEngine=m.engine --memPoolSize=workspace:1024M")
    assert trtexec_command("a b.onnx", "m.engine", True, 512, {"x": [4, 3, 224, 224], "y": [4, 2]}) == (
        "trtexec --onnx='a b.onnx' --saveEngine=m.engine --fp16 --memPoolSize=workspace:512M "
        "--shapes=x:4x3x224x224,y:4x2"
    )


@pytest.mark.skipif(HAVE_TENSORRT, reason="tensorrt is installed")
def test_build_engine_without_tensorrt(tiny: Path, tmp_path: Path) -> None:
    ready = prepare_for_tensorrt(tiny, tmp_path / "ready.onnx")
    engine = tmp_path / "ready.engine"
    with pytest.raises(TensorRTUnavailable) as e:
        build_engine(ready, engine, fp16=True, workspace_mb=256)
    msg = str(e.value)
    assert "TensorRT is not installed" in msg and "pip install onnxprune[tensorrt]" in msg and str(ready) in msg
    assert trtexec_command(ready, engine, True, 256, None) in msg
    assert not engine.exists()
    # A dynamic-batch ONNX gets --shapes with the default batch of 1.
    with pytest.raises(TensorRTUnavailable) as e:
        build_engine(tiny, engine)
    assert trtexec_command(tiny, engine, False, 1024, {"x": [1, 3, 8, 8]}) in str(e.value)


def test_build_engine_missing_onnx(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="nope.onnx"):
        build_engine(tmp_path / "nope.onnx", tmp_path / "e.engine")


# ---------------------------------------------------------------- benchmarks/latency.py --quick


@needs_real_model
def test_latency_benchmark_quick(tmp_path: Path) -> None:
    """The script's quick mode (one 245M model from 16 photos, batch 1): rows and table, no timing threshold."""
    subprocess.run([sys.executable, "benchmarks/latency.py", "--quick", "--data", str(DATA), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "latency.json").read_text())
    (row,) = result["rows"]
    assert row["model"] == "latency_245M.onnx" and row["batch"] == 1 and row["repeats"] == 2
    assert row["macs"] <= 245e6 and row["mac_ratio"] == pytest.approx(300.8e6 / row["macs"], rel=1e-3)
    assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"] and row["original_ms"] > 0
    assert "| latency_245M.onnx | 24" in (tmp_path / "latency.md").read_text()
    assert not (tmp_path / "latency_245M.onnx").exists()


def test_a_quantized_model_reaches_tensorrt_with_its_qdq_pairs(tiny: Path, tmp_path: Path) -> None:
    from onnxprune import api
    from onnxprune.deploy.quantize import QuantizeOptions

    calib = np.random.default_rng(0).standard_normal((20, 3, 8, 8)).astype(np.float32)
    quantized = tmp_path / "q.onnx"
    api.quantize(tiny, calib, options=QuantizeOptions(runtime="tensorrt", methods=("minmax",), float_ends="no")
                 ).save(quantized)
    exported = api.export(quantized, tmp_path / "q.engine", tensorrt=False)
    model = onnx.load(str(exported.onnx))
    weights = {t.name: t for t in model.graph.initializer}
    dq = [n for n in model.graph.node if n.op_type == "DequantizeLinear"]
    assert any(n.input[0] in weights and weights[n.input[0]].data_type == onnx.TensorProto.INT8 for n in dq)
    assert "--int8" in exported.trtexec.split()
    assert "--int8" not in api.export(tiny, tmp_path / "f.engine", tensorrt=False).trtexec.split()
