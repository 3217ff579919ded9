"""The Python API: options and strategies validated when built, naming the valid choices; ``onnxprune.compress``
on the tiny model, the same weights as the CLI; ``Result.save`` atomic."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from PIL import Image
from typer.testing import CliRunner

import onnxprune
from onnxprune.cli import app
from onnxprune.errors import OnnxPruneError
from onnxprune.recovery import RecoverOptions
from onnxprune.strategies import (
    OMP, CompressOptions, Auto, Curve, Global, MACs, Latency, Local, NoRefit, Output, Random, Ratio, Refit, Scale, Selector,
    Uniform, named,
    options_from,
)


@pytest.mark.parametrize(("field", "value", "choices"), [
    ("reconstruct", "ful", "refit, scale, none"),
    ("allocation", "unifrom", "epsilon, uniform, curve"),
    ("method", "magic", "omp, local, global, auto, l1, random"),
    ("target", "papers", "original, paper"),
])
def test_named_strategies_refuse_unknown_names(field: str, value: str, choices: str) -> None:
    names = {"method": "omp", "allocation": "epsilon", "reconstruct": "refit", "target": "original", field: value}
    with pytest.raises(OnnxPruneError, match=f"{field} '{value}' is not one of {choices}"):
        named(**names)


@pytest.mark.parametrize(("given", "recover_steps", "chosen"), [
    (None, 0, "output"), (None, 5, "recover"), ("output", 5, "output"), ("epsilon", 0, "epsilon")])
def test_the_allocation_a_flag_leaves_unsaid_is_recover_for_a_model_compress_trains(
        given: str | None, recover_steps: int, chosen: str) -> None:
    from onnxprune.flags.jobs import allocation
    assert allocation({"allocation": given, "recover_steps": recover_steps}) == chosen
    assert allocation({"allocation": given}) == (given or "output")  # sweep's flags: no recovery


def test_the_former_name_of_the_refit_says_its_new_one() -> None:
    with pytest.raises(OnnxPruneError, match="--reconstruct full is now called 'refit'"):
        named("omp", "epsilon", "full")


@pytest.mark.parametrize(("field", "value", "choices"), [
    ("budget", 0.5, r"MACs\(\), Ratio\(\), Latency\(\)"),
    ("select", "omp", r"OMP\(\), Local\(\), Global\(\), Auto\(\), L1\(\), Random\(\)"),
    ("allocate", Refit(), r"Epsilon\(\), Uniform\(\), Curve\(\)"),
    ("reconstruct", "refit", r"NoRefit\(\), Scale\(\), Refit\(\)"),
])
def test_compress_options_refuse_a_wrong_kind(field: str, value: object, choices: str) -> None:
    """CompressOptions holds strategy objects only: a name or another kind fails when built, listing the kind's."""
    with pytest.raises(OnnxPruneError, match=f"{field}=.*: give one of {choices}"):
        CompressOptions(**{"budget": Ratio(0.5), field: value})


@pytest.mark.parametrize(("field", "value", "choices"), [
    ("method", "blocks", "block\\+distill, block, distill"),
    ("train", "all", "segment, changed"),
    ("mix", "mixin", "mixup, cutmix, both, none"),
])
def test_recover_options_refuse_unknown_strategies(field: str, value: str, choices: str) -> None:
    with pytest.raises(OnnxPruneError, match=f"{field} '{value}' is not one of {choices}"):
        RecoverOptions(**{field: value})


@pytest.mark.parametrize(("build", "words"), [
    (lambda: Ratio(1.0), "strictly between 0 and 1"),
    (lambda: Ratio(0), "strictly between 0 and 1"),
    (lambda: MACs(0), "must be positive"),
    (lambda: Latency(), "exactly one of ms=... or ratio=..."),
    (lambda: Latency(ms=2.0, batch=0), "Latency(batch=0, threads=None)"),
    (lambda: Local("papr"), "imitate is not one of original, paper"),
    (lambda: Scale(ridge=-1.0), "at least 0"),
    (lambda: options_from(Ratio(0.5), "omp"), "give one of OMP(), Local(), Global(), Auto(), L1(), Random()"),
    (lambda: options_from(Ratio(0.5), allocate=Refit()), "give one of Epsilon(), Uniform(), Curve()"),
    (lambda: options_from(Ratio(0.5), method="omp"), "compress option(s) method are not among"),
    (lambda: options_from(Ratio(0.5), round_to=0), "round_to=0: a whole number of at least 1 (--round-to)"),
    (lambda: options_from(Ratio(0.5), provider="gpu"), "provider 'gpu' is not one of auto, cpu, cuda, tensorrt"),
    (lambda: named("magic", "epsilon", "refit"), "method 'magic' is not one of omp, local, global, auto, l1, random"),
    (lambda: named("omp", "output", "refit", global_budget=60), "the global budget is auto's, not omp's"),
    (lambda: Auto(budget=-1), "the global budget is seconds, at least 0"),
    (lambda: Global(steps=0), "Global(steps=0): must be at least 1"),
])
def test_strategies_refuse_bad_values_when_built(build, words: str) -> None:
    with pytest.raises(OnnxPruneError) as info:
        build()
    assert words in str(info.value)


def test_strategies_map_to_the_names_the_cli_gives() -> None:
    assert options_from(Ratio(0.6)) == CompressOptions(Ratio(0.6), OMP(), Output(), Refit())
    assert named("local", "uniform", "scale", target="paper") == (Local("paper"), Uniform(), Scale())
    assert named("random", "curve", "none", seed=3) == (Random(3), Curve(), NoRefit())
    options = options_from(Latency(ratio=0.8, batch=4, threads=2, cost_table=Path("t.json")),
                           *named("random", "curve", "none", seed=3), round_to=1)
    assert json.loads(json.dumps(options.to_dict())) == {
        "budget": {"kind": "Latency", "ms": None, "ratio": 0.8, "batch": 4, "threads": 2, "cost_table": "t.json",
                   "save_cost_table": None},
        "select": {"kind": "Random", "seed": 3}, "allocate": {"kind": "Curve"}, "reconstruct": {"kind": "NoRefit"},
        "min_channels": 1, "round_to": 1, "curve_samples": 128, "batch_size": 32, "provider": "auto",
        "best_effort": False, "residual_streams": False, "empty_samples": False, "memory": None, "spill_dir": None,
        "task": "auto"}


# ---------------------------------------------------------------- onnxprune.compress on the tiny model

def test_compress_from_paths_meets_the_budget_and_runs(tiny) -> None:
    result = onnxprune.compress(tiny.path, tiny.calib, budget=Ratio(0.6))
    assert result.report.macs_after <= 0.6 * result.report.macs_before
    assert result.report.layers and result.report.calibration_samples == 64
    sess = ort.InferenceSession(result.model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"input": np.zeros((2, 3, 32, 32), np.float32)})[0].shape == (2, 10)


def _weights(model: onnx.ModelProto) -> dict[str, bytes]:
    return {t.name: numpy_helper.to_array(t).tobytes() for t in model.graph.initializer}


@pytest.mark.parametrize(("flags", "strategies"), [
    ([], {}),
    (["--method", "local", "--reconstruct", "scale"], {"select": Local(), "reconstruct": Scale()}),
])
def test_compress_on_arrays_gives_the_cli_model_bit_for_bit(tiny, tmp_path: Path, flags, strategies) -> None:
    out = tmp_path / "cli.onnx"
    cli = CliRunner().invoke(app, ["compress", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib),
                                   "--target-ratio", "0.6", *flags])
    assert cli.exit_code == 0, cli.stderr
    result = onnxprune.compress(onnx.load(str(tiny.path)), {"input": tiny.x.copy()}, budget=Ratio(0.6),
                                **strategies)
    expected = _weights(onnx.load(str(out)))
    assert expected.keys() == _weights(result.model).keys()
    assert _weights(result.model) == expected


class FirstChannels(Selector):
    """A selector of one's own: the first ``width`` channels, its calls recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def select(self, ctx, group, data, width):
        self.calls.append((group.name, group.channels, width))
        return np.arange(width), np.ones(width), None


def test_a_selector_passed_in_is_what_runs(tiny) -> None:
    """The loop calls the Selector object given (no name in between): every pruned group keeps its first
    channels, and the written stem's weights are the original's first rows."""
    select = FirstChannels()
    result = onnxprune.compress(tiny.path, tiny.calib, budget=Ratio(0.6), select=select, reconstruct=NoRefit())
    assert select.calls and select.calls == [(x.group, x.channels, x.kept) for x in result.report.layers]
    assert result.report.options["select"] == {"kind": "FirstChannels"}
    stem = result.report.layers[0]  # named by its producer, the stem conv (which reads no pruned channels)
    w_original, w_pruned = (_weight_of(model, stem.group) for model in (onnx.load(str(tiny.path)), result.model))
    assert w_pruned.shape[0] == stem.kept < stem.channels and np.array_equal(w_pruned, w_original[: stem.kept])


def _weight_of(model: onnx.ModelProto, node_name: str) -> np.ndarray:
    node = next(n for n in model.graph.node if n.name == node_name)
    return next(numpy_helper.to_array(t) for t in model.graph.initializer if t.name == node.input[1])


def test_result_save_is_atomic(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    result = onnxprune.Result(onnx.load(str(tiny.path)), None)
    out = tmp_path / "m.onnx"
    out.write_bytes(b"the previous file")

    def fail(model, path) -> None:
        Path(path).write_bytes(b"half a model")
        raise OSError("disk full")

    monkeypatch.setattr(onnx, "save", fail)
    with pytest.raises(OSError, match="disk full"):
        result.save(out)
    assert out.read_bytes() == b"the previous file" and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    monkeypatch.undo()
    assert result.save(out) == out
    assert onnx.load(str(out)) == result.model and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    with pytest.raises(OnnxPruneError, match="would overwrite the input"):
        result.save(out, refuse=[out])


def test_readme_python_api_example_runs(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's example, as written, on the tiny model (its files copied to the names it uses)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    (example,) = re.findall(r"## Python API.*?```python\n(.*?)```", readme, re.S)
    shutil.copy(tiny.path, tmp_path / "tiny.onnx")
    shutil.copy(tiny.calib, tmp_path / "calib.npy")
    (tmp_path / "photos").mkdir()
    rng = np.random.default_rng(0)
    for label in (0, 3, 7):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(tmp_path / f"photos/{label:03d}_x.png")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["scores"].images == 3 and namespace["scores"].top1 is not None
    assert namespace["scores"].agreement is not None and len(namespace["timings"]) == 2
    pruned = onnx.load("tiny-pruned.onnx")
    assert [i.name for i in pruned.graph.input] == ["input"] and len(pruned.graph.node) > 0
    assert onnxprune.analyze(pruned).macs.total <= 0.6 * onnxprune.analyze(tiny.path).macs.total


def test_evaluate_and_bench_return_data(tiny, tmp_path: Path) -> None:
    """``evaluate`` on a ModelProto with ``limit`` and ``labels``, its default preprocessing sized from the model
    input; ``bench`` times several models, the first being the baseline."""
    rng = np.random.default_rng(1)
    (tmp_path / "photos").mkdir()
    for i in range(4):
        Image.fromarray(rng.integers(0, 256, (36, 40, 3), dtype=np.uint8)).save(tmp_path / f"photos/img{i}.png")
    unlabelled = onnxprune.evaluate(tiny.model, tmp_path / "photos", tiny.path, limit=3)
    assert unlabelled.images == 3 and unlabelled.top1 is None and unlabelled.agreement == 1.0
    assert unlabelled.to_dict()["kl"] == pytest.approx(0.0, abs=1e-9)
    labelled = onnxprune.evaluate(tiny.path, tmp_path / "photos", labels=lambda path: 0, subset="0:2")
    assert labelled.images == 2 and labelled.top1 is not None and labelled.agreement is None
    assert onnxprune.preprocess_for(tiny.path).crop == 32
    assert onnxprune.preprocess_for(tiny.path, crop=24).resize == round(24 * 256 / 224)
    timings = onnxprune.bench([tiny.path, tiny.path], provider="cpu", warmup=0, runs=2)
    assert [t.runs for t in timings] == [2, 2] and timings[0].macs == timings[1].macs


def test_recover_options_are_typed() -> None:
    assert RecoverOptions().method is onnxprune.Method.BLOCK_DISTILL
    assert RecoverOptions(method="distill").method is onnxprune.Method.DISTILL
    typed = RecoverOptions(train="changed", mix=onnxprune.Mix.CUTMIX, layout="nhwc")
    assert (typed.train, typed.mix, typed.layout) == (onnxprune.Train.CHANGED, onnxprune.Mix.CUTMIX,
                                                      onnxprune.Layout.NHWC)
    assert [(m.block, m.distill) for m in onnxprune.Method] == [(True, True), (True, False), (False, True)]


def test_result_recover_continues_compress(tiny) -> None:
    """``Result.recover`` trains towards the model compress started from, on its calibration samples."""
    result = onnxprune.compress(tiny.path, tiny.x, budget=Ratio(0.6))
    with pytest.raises(OnnxPruneError, match="continues a result of compress"):
        onnxprune.Result(result.model, result.report).recover()
    recovered = result.recover(RecoverOptions(method="block", steps=2, batch_size=16))
    assert recovered.report is result.report and recovered.recovery is not None
    assert recovered.to_dict()["recovery"]["options"]["method"] == "block"
    assert result.to_dict()["recovery"] is None


def test_export_without_tensorrt_returns_the_trtexec_command(tiny, tmp_path: Path) -> None:
    exported = onnxprune.export(tiny.path, tmp_path / "m.engine", tensorrt=False, input_shape=["1x3x32x32"])
    assert exported.onnx == tmp_path / "m.trt.onnx" and exported.onnx.is_file() and exported.engine is None
    assert exported.trtexec.startswith("trtexec ") and "m.engine" in exported.trtexec
