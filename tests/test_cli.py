"""The command line: `analyze --json`, a successful `compress`, and one-line errors (exit 2) for bad inputs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image
from typer.testing import CliRunner

import onnxprune.api as api
from onnxprune.analysis import analyze
from onnxprune.cli import app
from onnxprune.deploy.export import TensorRTUnavailable, trtexec_command
from onnxprune.errors import ModelError
from onnxprune.strategies import Output
from tests.onnx_builders import GraphBuilder, export_tiny, session

runner = CliRunner()


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("cli")
    f = {"tiny": tiny.path, "calib": tiny.calib}
    f["static"] = export_tiny(d / "static.onnx", dynamic_batch=False)  # input fixed to 1x3x32x32
    f["text"] = d / "notes.onnx"
    f["text"].write_text("this is a text file, not an ONNX model\n" * 20)
    data = tiny.path.read_bytes()
    f["truncated"] = d / "truncated.onnx"
    f["truncated"].write_bytes(data[: len(data) // 2])
    b = GraphBuilder({"input": ["batch", 3, 32, 32]})
    f["relu"] = d / "relu.onnx"
    onnx.save(b.model([b.op("Relu", ["input"], "relu")]), f["relu"])
    b = GraphBuilder({"input": ["batch", 3, 32, 32]})
    q = b.op("DynamicQuantizeLinear", ["input"], "quant", outputs=3)
    w = b.const("w", np.ones((8, 3, 3, 3)), dtype=np.uint8)
    y = b.op("ConvInteger", [q, w, "quant_out2"], "conv_int")
    f["quantized"] = d / "quantized.onnx"  # dynamically quantized, as onnxruntime's quantize_dynamic writes
    onnx.save(b.model([b.op("Cast", [y], "cast", to=onnx.TensorProto.FLOAT)]), f["quantized"])
    b = GraphBuilder({"input": ["batch", 3, 32, 32]})
    f["conv"] = d / "conv.onnx"
    onnx.save(b.model([b.conv("input", "conv", 3, 8)]), f["conv"])
    f["empty"] = d / "empty"
    f["empty"].mkdir()
    f["images"] = d / "images"
    f["images"].mkdir()
    for i in range(3):
        Image.new("RGB", (300, 260), (40 * i, 90, 200)).save(f["images"] / f"{i}_img.png")
    return f


def test_analyze_json(files) -> None:
    result = runner.invoke(app, ["analyze", "--json", str(files["tiny"])])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["macs"] == analyze(onnx.load(str(files["tiny"]))).macs.total
    assert data["params"] > 0 and 0 < data["prunable_mac_share"] <= 1
    groups = data["groups"]
    assert [g["channels"] for g in groups] == [16, 8, 32, 12, 48, 64, 10]
    assert [g["prunable"] for g in groups] == [True] * 6 + [False]
    assert groups[3]["coupled"] and "graph output" in groups[-1]["reason"]
    assert data["task"] == "classify"  # the tiny net's [N, 10] logits


def test_analyze_json_keeps_library_warnings_off_stdout(files, monkeypatch) -> None:
    """graph-surgeon prints its warnings: under the CLI they go to stderr, and `--json`'s stdout still parses."""
    from onnx_graphsurgeon.logger import G_LOGGER

    import onnxprune.cli.prune as prune

    real = prune.api.analyze

    def warned(*args, **kwargs):
        G_LOGGER.warning("a graph-surgeon warning")
        return real(*args, **kwargs)

    monkeypatch.setattr(prune.api, "analyze", warned)
    result = runner.invoke(app, ["analyze", "--json", str(files["tiny"])])
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["groups"] and "a graph-surgeon warning" in result.stderr


def test_analyze_table(files) -> None:
    result = runner.invoke(app, ["analyze", str(files["tiny"])])
    assert result.exit_code == 0, result.stderr
    assert "6/7 groups prunable" in result.stdout
    assert "task: classify (read from the outputs' layout" in result.stdout


def test_compress_writes_model_and_report(files, tmp_path: Path) -> None:
    out, report = tmp_path / "pruned.onnx", tmp_path / "report.json"
    result = runner.invoke(app, ["compress", str(files["tiny"]), "-o", str(out), "--calib", str(files["calib"]),
                                 "--target-ratio", "0.6", "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["macs_after"] <= 0.6 * data["macs_before"]
    assert data["options"]["allocate"]["kind"] == "Output" and "allocation=output" in result.stdout
    assert data["layers"] and all(layer["kept"] < layer["channels"] for layer in data["layers"])
    assert data["calibration_samples"] == 64
    onnx.checker.check_model(str(out))
    sess = session(out)
    x = np.zeros((2, 3, 32, 32), np.float32)
    assert sess.run(None, {"input": x})[0].shape == (2, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pruned.onnx", "report.json"]  # no temp files left
    mask = os.umask(0)
    os.umask(mask)
    assert {oct(p.stat().st_mode & 0o777) for p in (out, report)} == {oct(0o666 & ~mask)}  # not mkstemp's 0600


def test_compress_recover_steps_with_unseen_held_out_samples(files, tmp_path: Path) -> None:
    out, report = tmp_path / "pruned.onnx", tmp_path / "report.json"
    result = runner.invoke(app, ["compress", str(files["tiny"]), "-o", str(out), "--calib", str(files["calib"]),
                                 "--subset", "0:48", "--target-ratio", "0.6", "--recover-steps", "5",
                                 "--recover-held-subset", "48:64", "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    recovery = json.loads(report.read_text())["recovery"]
    assert (recovery["samples_train"], recovery["samples_held"], recovery["held_unseen"]) == (48, 16, True)
    assert recovery["options"]["steps"] == 5 and recovery["segments"] and recovery["distill"]
    # a model compress trains is pruned for recover by default: its first layers more, its last ones less
    assert json.loads(report.read_text())["options"]["allocate"]["kind"] == "Recoverable"
    assert "allocation=recover" in result.stdout
    printed = " ".join(result.stdout.split())
    assert "on 8 of 16 held-out samples (the other 8 picked the checkpoints; given apart; 48 trained on)" in printed
    assert (f"training kl {recovery['train_before']:.4f} → {recovery['train_after']:.4f}, agreement "
            f"{recovery['train_agreement_before']:.1%} → {recovery['train_agreement_after']:.1%} on the 48 samples "
            "trained on") in printed


def test_target_flops_with_suffix(files, tmp_path: Path) -> None:
    total = analyze(onnx.load(str(files["tiny"]))).macs.total
    out = tmp_path / "pruned.onnx"
    result = runner.invoke(app, ["compress", str(files["tiny"]), "-o", str(out), "--calib", str(files["calib"]),
                                 "--target-flops", f"{0.7 * total / 1e3:.3f}k", "--reconstruct", "scale"])
    assert result.exit_code == 0, result.stderr
    assert analyze(onnx.load(str(out))).macs.total <= 0.7 * total


def test_best_effort_prunes_to_the_lowest_reachable_macs(files, tmp_path: Path) -> None:
    from onnxprune.budget.allocation import lowest_macs
    from onnxprune.pipeline import schedule
    from onnxprune.ir.cuts import Liveness

    analysis = analyze(onnx.load(str(files["tiny"])))
    groups = [g for _, g in schedule(analysis, Liveness(analysis.graph))[0]]
    floor = lowest_macs(analysis.macs, groups, round_to=8, share=min(Output().ratios))  # the default allocation's
    argv = ["compress", str(files["tiny"]), "--calib", str(files["calib"]), "--target-ratio", "0.001"]
    refused = runner.invoke(app, [*argv, "-o", str(tmp_path / "refused.onnx")])
    assert refused.exit_code == 2 and "unreachable" in refused.stderr and "--best-effort" in refused.stderr
    out, report = tmp_path / "pruned.onnx", tmp_path / "report.json"
    result = runner.invoke(app, [*argv, "-o", str(out), "--best-effort", "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    assert "--best-effort" in result.stdout and "lowest reachable" in result.stdout
    data = json.loads(report.read_text())
    assert data["requested_macs"] == pytest.approx(0.001 * data["macs_before"])
    assert data["target_macs"] == pytest.approx(floor) and data["macs_after"] == pytest.approx(floor, rel=1e-6)
    assert not (tmp_path / "refused.onnx").exists()
    assert session(out).run(None, {"input": np.zeros((2, 3, 32, 32), np.float32)})[0].shape == (2, 10)


def test_best_effort_is_silent_when_the_budget_is_reachable(files, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = runner.invoke(app, ["compress", str(files["tiny"]), "-o", str(tmp_path / "p.onnx"), "--calib",
                                 str(files["calib"]), "--target-ratio", "0.7", "--best-effort", "--allocation",
                                 "uniform", "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    assert "--best-effort" not in result.stdout
    data = json.loads(report.read_text())
    assert data["requested_macs"] is None and data["macs_after"] <= 0.7 * data["macs_before"]


# ---------------------------------------------------------------- bad inputs

# name -> (argv builder, words the error must contain)
BAD = {
    "text-file": (lambda f, o: ["compress", str(f["text"]), "-o", o, "--calib", str(f["calib"]), "--target-ratio", "0.5"],
                  ["notes.onnx", "not a readable ONNX model"]),
    "truncated": (lambda f, o: ["compress", str(f["truncated"]), "-o", o, "--calib", str(f["calib"]),
                                "--target-ratio", "0.5"], ["truncated.onnx", "truncated"]),
    "no-group-relu": (lambda f, o: ["compress", str(f["relu"]), "-o", o, "--calib", str(f["calib"]),
                                    "--target-ratio", "0.5"], ["no prunable channel group", "no channels run from"]),
    "no-group-quantized": (lambda f, o: ["compress", str(f["quantized"]), "-o", o, "--calib", str(f["calib"]),
                                         "--target-ratio", "0.5"], ["no prunable channel group",
                                                                    "quantized (ConvInteger, DynamicQuantizeLinear)",
                                                                    "prune the float model"]),
    "no-group-conv": (lambda f, o: ["compress", str(f["conv"]), "-o", o, "--calib", str(f["calib"]),
                                    "--target-ratio", "0.5"], ["no prunable channel group in this graph (1 group: ", "graph output"]),
    "ratio-unreachable": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["calib"]),
                                        "--target-ratio", "0.001"], ["unreachable"]),
    "flops-above-original": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["calib"]),
                                           "--target-flops", "2G"], ["not below"]),
    "empty-calib-folder": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["empty"]),
                                         "--target-ratio", "0.5"], ["no images", "empty"]),
    "images-do-not-fit": (lambda f, o: ["compress", str(f["static"]), "-o", o, "--calib", str(f["images"]),
                                        "--crop", "224", "--target-ratio", "0.5"], ["224", "[3, 32, 32]", "(--crop)"]),
    "bench-bad-batch": (lambda f, o: ["bench", str(f["tiny"]), "--batch", "0"], ["batch 0 is invalid", "(--batch)"]),
    "output-is-input": (lambda f, o: ["compress", str(f["tiny"]), "-o", str(f["tiny"]), "--calib", str(f["calib"]),
                                      "--target-ratio", "0.5"], ["is the input model"]),
    "missing-model": (lambda f, o: ["compress", str(Path(o).parent / "nope.onnx"), "-o", o, "--calib",
                                    str(f["calib"]), "--target-ratio", "0.5"], ["nope.onnx", "no such file"]),
    "missing-calib": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(Path(o).parent / "no.npy"),
                                    "--target-ratio", "0.5"], ["no.npy", "not found"]),
    "both-targets": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["calib"]),
                                   "--target-ratio", "0.5", "--target-flops", "1M"], ["exactly one"]),
    "bad-method": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["calib"]),
                                 "--target-ratio", "0.5", "--method", "magic"], ["--method", "magic"]),
    "recover-no-views": (lambda f, o: ["recover", str(f["tiny"]), "--teacher", str(f["tiny"]), "-o", o, "--calib",
                                       str(f["calib"]), "--distill-views", "0"], ["distill_views 0 must be at least 1", "--distill-views"]),
    "recover-negative-segments": (lambda f, o: ["recover", str(f["tiny"]), "--teacher", str(f["tiny"]), "-o", o,
                                                "--calib", str(f["calib"]), "--distill-segments", "-1"],
                                  ["distill_segments -1 must be at least 0", "--distill-segments"]),
    "held-without-recovery": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["calib"]),
                                            "--target-ratio", "0.5", "--recover-held-subset", "0:8"],
                              ["--recover-held-subset", "--recover-steps"]),
    # output paths are checked before any work: the missing calibration file would fail later
    "output-folder-missing": (lambda f, o: ["compress", str(f["tiny"]), "-o", str(Path(o).parent / "no" / "p.onnx"),
                                            "--calib", str(Path(o).parent / "no.npy"), "--target-ratio", "0.5"],
                              ["-o file", "does not exist"]),
    "report-folder-missing": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(Path(o).parent / "no.npy"),
                                            "--target-ratio", "0.5", "--report", str(Path(o).parent / "no" / "r.json")],
                              ["--report file", "does not exist"]),
    "report-is-a-folder": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["calib"]),
                                         "--target-ratio", "0.5", "--report", str(Path(o).parent)],
                           ["is a directory", "--report file"]),
    "cost-table-folder-missing": (lambda f, o: ["compress", str(f["tiny"]), "-o", o, "--calib", str(f["calib"]),
                                                "--target-latency", "0.8x", "--save-cost-table",
                                                str(Path(o).parent / "no" / "t.json")],
                                  ["--save-cost-table file", "does not exist"]),
    "recover-report-folder-missing": (lambda f, o: ["recover", str(f["tiny"]), "--teacher", str(f["tiny"]), "-o", o,
                                                    "--calib", str(f["calib"]), "--report",
                                                    str(Path(o).parent / "no" / "r.json")],
                                      ["--report file", "does not exist"]),
    "analyze-text-file": (lambda f, o: ["analyze", str(f["text"])], ["notes.onnx", "not a readable ONNX model"]),
    "analyze-missing": (lambda f, o: ["analyze", str(Path(o).parent / "nope.onnx")], ["nope.onnx", "no such file"]),
    # run with TensorRT reported missing: no .trt.onnx is left behind
    "export-without-tensorrt": (lambda f, o: ["export", str(f["tiny"]), "-o", o],
                                ["TensorRT is not installed", "--no-tensorrt"]),
    "export-missing-model": (lambda f, o: ["export", str(Path(o).parent / "nope.onnx"), "-o", o, "--no-tensorrt"],
                             ["nope.onnx", "no such file"]),
}


def _invoke_bad(files, tmp_path: Path, name: str):
    argv, words = BAD[name]
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    tiny_mtime = files["tiny"].stat().st_mtime_ns
    result = runner.invoke(app, argv(files, str(out_dir / "pruned.onnx")))
    assert list(out_dir.iterdir()) == [], "no output (or temp) file may be written"
    assert files["tiny"].stat().st_mtime_ns == tiny_mtime
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == ""
    return result, words


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exits_2_naming_the_cause(files, tmp_path: Path, monkeypatch, name: str) -> None:
    monkeypatch.setattr(api, "have_tensorrt", lambda: False)
    result, words = _invoke_bad(files, tmp_path, name)
    lines = result.stderr.splitlines()
    assert result.stderr.count("\n") == 1 and lines[0].startswith("error: "), repr(result.stderr)
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_error_message_keeps_brackets_in_paths(tmp_path: Path) -> None:
    missing = tmp_path / "run[bold]" / "[v2]model.onnx"
    result = runner.invoke(app, ["analyze", str(missing)])
    assert result.exit_code == 2
    assert str(missing) in result.stderr, result.stderr


# ---------------------------------------------------------------- recover, bench


@pytest.fixture(scope="module")
def student(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model pruned to 60% of its MACs."""
    from onnxprune.calib.sources import load_calibration
    from onnxprune.pipeline import compress
    from onnxprune.strategies import Ratio, options_from
    from onnxprune.ir.ort import model_input_specs

    pruned, _ = compress(tiny.model, load_calibration(str(tiny.calib), model_input_specs(tiny.model)),
                         options_from(Ratio(0.6)))
    path = tmp_path_factory.mktemp("student") / "student.onnx"
    onnx.save(pruned, str(path))
    return path


def _kl(teacher: np.ndarray, student: np.ndarray) -> float:
    """Mean KL(softmax(teacher) || softmax(student)) over the rows."""
    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(1, keepdims=True)
        return z - np.log(np.exp(z).sum(1, keepdims=True))

    lt, ls = log_softmax(teacher.astype(np.float64)), log_softmax(student.astype(np.float64))
    return float((np.exp(lt) * (lt - ls)).sum(1).mean())


def _io(path: Path) -> list:
    sess = session(path)
    return [[(v.name, v.shape) for v in values] for values in (sess.get_inputs(), sess.get_outputs())]


def test_recover_writes_a_model_at_least_as_close_to_the_teacher(files, student, tmp_path: Path) -> None:
    """A few steps at a high learning rate (here they make the student worse): the written model is never further
    from the teacher on the held-out samples than the student, and the report says which was kept."""
    out, report = tmp_path / "recovered.onnx", tmp_path / "r.json"
    result = runner.invoke(app, ["recover", str(student), "--teacher", str(files["tiny"]), "-o", str(out), "--calib",
                                 str(files["calib"]), "--subset", "0:48", "--held-subset", "48:64", "--steps", "5",
                                 "--lr", "1e-2", "--distill-steps", "5", "--distill-lr", "1e-2", "--distill-views", "1",
                                 "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    onnx.checker.check_model(str(out))
    assert _io(out) == _io(student)
    x = {"input": np.load(files["calib"])[48:64][1::2]}  # the held-out half that judges (the other picks checkpoints)
    teacher = session(files["tiny"]).run(None, x)[0]
    before, after = (_kl(teacher, session(m).run(None, x)[0]) for m in (student, out))
    assert after <= before + 1e-9
    data = json.loads(report.read_text())
    assert data["metric"] == "kl" and data["before"] == pytest.approx(before, rel=1e-3)
    assert after == pytest.approx(data["after"] if data["improved"] else before, rel=1e-3)


@pytest.mark.parametrize("as_json", [True, False])
@pytest.mark.parametrize("spin", [True, False])
def test_bench_reports_a_row_per_model(files, student, as_json: bool, spin: bool) -> None:
    result = runner.invoke(app, ["bench", str(files["tiny"]), str(student), "--provider", "cpu", "--threads", "1",
                                 "--batch", "2", "--warmup", "1", "--runs", "3", *(["--json"] if as_json else []),
                                 *([] if spin else ["--no-spin"])])
    assert result.exit_code == 0, result.stderr
    if not as_json:
        rows = [line for line in result.stdout.splitlines() if ".onnx" in line]
        assert [row.split()[1] for row in rows] == ["tiny.onnx", "student.onnx"], result.stdout
        assert ("threads sleeping between nodes" in result.stdout) is not spin
        return
    rows = json.loads(result.stdout)
    assert [r["model"] for r in rows] == [str(files["tiny"]), str(student)]
    for r in rows:
        assert (r["provider"], r["batch"], r["threads"], r["runs"], r["spin"]) == ("CPUExecutionProvider", 2, 1, 3,
                                                                                   spin)
        assert 0 < r["median_ms"] <= r["p99_ms"] and r["throughput"] > 0
    assert 0 < rows[1]["macs"] < rows[0]["macs"]


# ---------------------------------------------------------------- export


def test_export_no_tensorrt_writes_an_equivalent_ready_onnx_and_the_trtexec_command(files, tmp_path: Path) -> None:
    engine = tmp_path / "m.engine"
    result = runner.invoke(app, ["export", str(files["tiny"]), "-o", str(engine), "--no-tensorrt", "--fp16",
                                 "--workspace", "256"])
    assert result.exit_code == 0, result.stderr
    ready = tmp_path / "m.trt.onnx"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.trt.onnx"]  # no engine, no temp file
    lines = result.stdout.splitlines()
    assert f"TensorRT-ready ONNX written to {ready}" in lines and "no engine built" in result.stdout
    assert trtexec_command(ready, engine, True, 256, None) in lines and result.stderr == ""
    onnx.checker.check_model(str(ready))
    x = np.load(files["calib"])[:1]
    prepared = session(ready)
    assert [i.shape for i in prepared.get_inputs()] == [[1, 3, 32, 32]]
    np.testing.assert_allclose(prepared.run(None, {"input": x})[0], session(files["tiny"]).run(None, {"input": x})[0],
                               rtol=1e-4, atol=1e-5)


def _fake_engine(path: Path, out: Path, **kw) -> Path:
    out.write_bytes(b"engine")
    return out


def _raise(exc: Exception):
    def fail(*a, **kw):
        raise exc
    return fail


# case -> (build_engine and engine_latency stand-ins, exit code, files left, words in stdout + stderr)
ENGINE_CASES = {
    "timed": (_fake_engine, lambda path: {"engine": str(path), "median_ms": 0.5}, 0, ["m.engine", "m.trt.onnx"],
              ["TensorRT engine written to", '"median_ms": 0.5']),
    "no-cuda-buffers": (_fake_engine, _raise(TensorRTUnavailable("timing needs CUDA buffers")), 0,
                        ["m.engine", "m.trt.onnx"],
                        ["TensorRT engine written to", "warning: the engine is not timed: timing needs CUDA buffers"]),
    "engine-does-not-run": (_fake_engine, _raise(ModelError("TensorRT cannot load the engine")), 2, [],
                            ["error: TensorRT cannot load the engine"]),
    "build-fails": (_raise(ModelError("TensorRT cannot parse the model")), None, 2, [],
                    ["error: TensorRT cannot parse the model"]),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_export_with_tensorrt(files, tmp_path: Path, monkeypatch, case: str) -> None:
    """The engine path with TensorRT stood in for: a failure after the ONNX is prepared leaves no file."""
    build, latency, code, left, words = ENGINE_CASES[case]
    monkeypatch.setattr(api, "have_tensorrt", lambda: True)
    monkeypatch.setattr(api, "build_engine", build)
    monkeypatch.setattr(api, "engine_latency", latency)
    result = runner.invoke(app, ["export", str(files["tiny"]), "-o", str(tmp_path / "m.engine")])
    assert result.exit_code == code, (result.stdout, result.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == left
    for word in words:
        assert word in " ".join((result.stdout + result.stderr).split()), word


def test_too_few_samples_for_the_output_allocation_name_the_way_out(files, tmp_path: Path) -> None:
    """The default allocation probes on two disjoint halves of the calibration set: 4 samples are one line,
    exit 2, naming --allocation; the ε allocation takes them."""
    argv = ["compress", str(files["tiny"]), "--calib", str(files["calib"]), "--limit", "4", "--target-ratio", "0.7"]
    refused = runner.invoke(app, [*argv, "-o", str(tmp_path / "refused.onnx")])
    assert refused.exit_code == 2 and "at least 6 calibration samples" in refused.stderr
    assert "(--allocation)" in refused.stderr and not (tmp_path / "refused.onnx").exists()
    taken = runner.invoke(app, [*argv, "-o", str(tmp_path / "eps.onnx"), "--allocation", "epsilon"])
    assert taken.exit_code == 0, taken.stderr


def test_remove_blocks_probes_the_removal_and_needs_the_output_allocation(files, tmp_path: Path) -> None:
    """--remove-blocks: the block's removal is probed (width 0 in the report's probes) and `analyze` marks the
    block; with another allocation it is one error line, exit 2, nothing written."""
    table = runner.invoke(app, ["analyze", str(files["tiny"])])
    assert table.stdout.count("(a removable block)") == 1
    argv = ["compress", str(files["tiny"]), "--calib", str(files["calib"]), "--target-ratio", "0.6", "--remove-blocks"]
    report = tmp_path / "report.json"
    result = runner.invoke(app, [*argv, "-o", str(tmp_path / "p.onnx"), "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    probes = json.loads(report.read_text())["allocation"]["probes"]
    block = analyze(onnx.load(str(files["tiny"]))).groups[4].name
    assert [name for name, row in probes.items() if "0" in row] == [block]
    refused = runner.invoke(app, [*argv, "-o", str(tmp_path / "r.onnx"), "--allocation", "epsilon"])
    assert refused.exit_code == 2 and "output allocation" in refused.stderr and "--remove-blocks" in refused.stderr
    assert not (tmp_path / "r.onnx").exists()


def test_flag_values_take_the_library_defaults() -> None:
    """A flag list read by the CLI's own parser (what the benchmarks do): absent flags take the library's
    defaults, and the objects built from the values are those the library defaults to."""
    from onnxprune.flags import declared, jobs
    from onnxprune.cli import flag_values
    from onnxprune.strategies import CompressOptions, Ratio, named

    v = flag_values("compress", ["m.onnx", "-o", "p.onnx", "--calib", "photos", "--target-ratio", "0.5",
                                 "--input-shape", "1x3x8x8", "--round-to", "4"])
    assert named(v["method"], jobs.allocation(v), v["reconstruct"]) == (
        CompressOptions.select, CompressOptions.allocate, CompressOptions.reconstruct)
    assert (v["batch_size"], v["provider"], v["task"], v["round_to"]) == (
        CompressOptions.batch_size, CompressOptions.provider, CompressOptions.task, 4)
    assert v["input_shape"] == ["1x3x8x8"] and jobs.budget(v) == Ratio(0.5)
    assert flag_values("bench", ["a.onnx"])["input_shape"] is None  # no --input-shape: None, as the CLI passes it
    r = flag_values("recover", ["s.onnx", "--teacher", "t.onnx", "-o", "r.onnx", "--calib", "photos"])
    fields = ("method", "lr", "block_window", "distill_lr", "distill_segments", "distill_views", "distill_features",
              "mix", "colour", "mosaic", "leaves", "steer", "whole_share", "temperature", "pool", "average", "holdout",
              "train", "pull", "optimizer", "batch_size", "seed", "provider")
    assert {k: r[k] for k in fields} == {k: getattr(declared.RECOVER, k) for k in fields}
    assert (r["steps"], r["distill_steps"], r["time"]) == (None, None, None)  # RecoverOptions: the default time
    with pytest.raises(Exception, match="No such option: --no-such-flag"):
        flag_values("compress", ["m.onnx", "-o", "p.onnx", "--calib", "photos", "--no-such-flag"])


def test_recover_threads_follow_omp_num_threads_else_every_usable_core(monkeypatch) -> None:
    import torch

    from onnxprune.cli import torch_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch_threads()
        assert torch.get_num_threads() == len(os.sched_getaffinity(0))
        torch.set_num_threads(1)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_long_commands_restart_with_huge_pages_where_glibc_takes_them() -> None:
    """``compress``/``recover``/``sweep`` restart once with glibc's huge-page tunable (glibc 2.35+, transparent huge
    pages on); never a short command, never over a GLIBC_TUNABLES already set (the restart's own, or the user's)."""
    from onnxprune.runtime.hugepages import TUNABLE, restart_environment

    on, glibc = "always [madvise] never", "glibc 2.36"
    env = restart_environment(["onnxprune", "compress", "m.onnx"], {"PATH": "/bin"}, glibc, on)
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": TUNABLE}
    assert restart_environment(["onnxprune", "--quiet", "sweep"], {}, glibc, "[always] madvise never") is not None
    for argv, environ, libc, thp in [
        (["onnxprune", "analyze", "m.onnx"], {}, glibc, on),  # short
        (["onnxprune", "compress"], {"GLIBC_TUNABLES": ""}, glibc, on),  # the user's choice, or restarted already
        (["onnxprune", "compress"], {}, "glibc 2.31", on),  # no such tunable
        (["onnxprune", "compress"], {}, None, on),  # another C library
        (["onnxprune", "compress"], {}, glibc, "always madvise [never]"),  # huge pages off
    ]:
        assert restart_environment(argv, environ, libc, thp) is None


def test_a_restart_that_cannot_start_runs_on_with_glibcs_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the interpreter cannot be started again, the command goes on in its own process instead of failing."""
    from onnxprune.runtime import hugepages

    tried = []

    def execve(*args) -> None:
        tried.append(args)
        raise OSError("no such interpreter")

    monkeypatch.setattr(hugepages.sys, "argv", ["onnxprune", "compress", "m.onnx"])
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(hugepages.os, "execve", execve)
    monkeypatch.setattr(hugepages.os, "confstr", lambda name: "glibc 2.36")
    monkeypatch.setattr(hugepages, "_THP", type("T", (), {"read_text": staticmethod(lambda: "always [madvise] never")})())
    monkeypatch.setattr(hugepages.sys, "platform", "linux")
    hugepages.restart_with_huge_pages()
    assert tried and tried[0][2]["GLIBC_TUNABLES"] == hugepages.TUNABLE


def test_the_restart_comes_before_the_heavy_imports() -> None:
    """The console entry decides on the huge-page restart having imported neither torch nor onnxruntime (a restart
    after them would pay their import twice), and the API's names still come from ``import onnxprune``."""
    import subprocess
    import sys

    code = ("import sys, onnxprune.__main__; print(sorted({'torch', 'onnxruntime'} & set(sys.modules)));"
            "import onnxprune; print(onnxprune.compress.__module__, onnxprune.strategies.Ratio.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "[]" and out[1] == "onnxprune.api Ratio"
