"""Fidelity evaluation and onnxruntime sessions on a tiny GlobalAveragePool + Gemm classifier."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from PIL import Image
from rich.console import Console

from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from onnxprune.errors import CalibrationError, ModelError, OnnxPruneError
from onnxprune.tables import format_table
from onnxprune.deploy.evaluation import EvalResult, evaluate
from onnxprune.ir import ort as ort_runtime
from onnxprune.ir.ort import make_session, model_input_specs, model_output_names, run_session

# Class scores are W @ (per-channel mean of the normalised image).
W = np.array(
    [[1, 0, 0], [0, 1, 0], [0, 0, 1], [-1, 0, 0], [0, -1, 0], [0, 0, -1], [0.5, 0.5, 0.5], [-0.5, -0.5, -0.5]],
    np.float32,
)
W_SWAPPED = W[[4, 1, 2, 3, 0, 5, 6, 7]]  # classes 0 and 4 exchanged
RED = (np.array([1.0, 0.0, 0.0]) - IMAGENET_MEAN) / IMAGENET_STD  # normalised channel means of a red image
# For a red image the ranking is 0, 4, 5, 7, 6 | 2, 1, 3.
PRE = Preprocess(resize=None, crop=None)  # crop to the model's 32x32


def classifier(
    path: Path, weight: np.ndarray = W, batch: int | str = "batch", outputs: tuple[str, ...] = ("logits", "pooled")
) -> Path:
    """GlobalAveragePool -> Flatten -> Gemm over a [batch,3,32,32] input; ``outputs`` picks the graph outputs."""
    classes = weight.shape[0]
    value_infos = {
        "logits": helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes]),
        "pooled": helper.make_tensor_value_info("pooled", TensorProto.FLOAT, [batch, 3, 1, 1]),
    }
    graph = helper.make_graph(
        [
            helper.make_node("GlobalAveragePool", ["x"], ["pooled"]),
            helper.make_node("Flatten", ["pooled"], ["flat"]),
            helper.make_node("Gemm", ["flat", "w", "b"], ["logits"], transB=1),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 32, 32])],
        [value_infos[name] for name in outputs],
        initializer=[numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.zeros(classes, np.float32), "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


def red_images(folder: Path, names: list[str]) -> Path:
    """Solid red 40x36 images named ``names`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        Image.new("RGB", (40, 36), (255, 0, 0)).save(folder / name)
    return folder


@pytest.fixture
def labelled(tmp_path: Path) -> Path:
    """Three red images labelled 0 (top-1 hit), 4 (top-5 hit) and 1 (miss)."""
    return red_images(tmp_path / "val", ["000_n0000_cat.png", "004_n0004_dog.png", "001_n0001_cow.png"])


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def test_top1_top5_and_self_reference(tmp_path: Path, labelled: Path) -> None:
    model = classifier(tmp_path / "m.onnx")
    result = evaluate(model, labelled, ref=model, preprocess=PRE, provider="cpu")
    assert result.images == 3 and result.provider == "CPUExecutionProvider"
    assert result.top1 == pytest.approx(1 / 3) and result.top5 == pytest.approx(2 / 3)
    assert result.agreement == 1.0 and result.kl == pytest.approx(0.0, abs=1e-9)
    assert result.rel_l2 == pytest.approx({"logits": 0.0, "pooled": 0.0}, abs=1e-9)
    assert result.cosine == pytest.approx({"logits": 1.0, "pooled": 1.0})
    assert set(result.to_dict()) == {"images", "provider", "top1", "top5", "agreement", "kl", "rel_l2", "cosine", "task",
                                     "metrics", "spread", "padded"}
    assert result.task == "classify" and result.metrics == {}
    third = np.sqrt(1 / 3 * 2 / 3 / 3)  # a share p of n images varies by sqrt(p (1 - p) / n) over their resamples
    assert result.spread == pytest.approx({"top1": third, "top5": third, "agreement": 0.0, "kl": 0.0}, abs=1e-9)


def test_different_reference(tmp_path: Path, labelled: Path) -> None:
    model = classifier(tmp_path / "m.onnx")
    ref = classifier(tmp_path / "ref.onnx", W_SWAPPED)
    result = evaluate(model, labelled, ref=ref, preprocess=PRE, batch_size=2)
    z, z_ref = W.astype(np.float64) @ RED, W_SWAPPED.astype(np.float64) @ RED
    lp, lq = log_softmax(z_ref), log_softmax(z)
    assert result.agreement == 0.0  # the ref predicts class 4, the model class 0
    assert result.kl == pytest.approx(float((np.exp(lp) * (lp - lq)).sum()), rel=1e-4) and result.kl > 0
    assert result.rel_l2["logits"] == pytest.approx(np.linalg.norm(z - z_ref) / np.linalg.norm(z_ref), rel=1e-4)
    assert result.cosine["logits"] == pytest.approx(z @ z_ref / np.linalg.norm(z) / np.linalg.norm(z_ref), rel=1e-4)
    assert result.rel_l2["pooled"] == pytest.approx(0.0, abs=1e-9)


def test_the_kl_varies_over_the_images_by_its_standard_error(tmp_path: Path) -> None:
    """Two red images and two blue ones against a reference with two classes swapped: the per-image KL takes two
    values, and the spread is their standard deviation over the square root of the image count."""
    folder = red_images(tmp_path / "mixed", ["a.png", "b.png"])
    for name in ("c.png", "d.png"):
        Image.new("RGB", (40, 36), (0, 0, 255)).save(folder / name)
    model, ref = classifier(tmp_path / "m.onnx"), classifier(tmp_path / "ref.onnx", W_SWAPPED)
    result = evaluate(model, folder, ref=ref, preprocess=PRE)
    blue = (np.array([0.0, 0.0, 1.0]) - IMAGENET_MEAN) / IMAGENET_STD
    kls = []
    for colour in (RED, blue):
        lp, lq = log_softmax(W_SWAPPED.astype(np.float64) @ colour), log_softmax(W.astype(np.float64) @ colour)
        kls.append(float((np.exp(lp) * (lp - lq)).sum()))
    assert kls[0] != pytest.approx(kls[1])
    assert result.kl == pytest.approx(np.mean(kls), rel=1e-4)
    assert result.spread["kl"] == pytest.approx(np.std(kls) / np.sqrt(4), rel=1e-3)


def test_rel_l2_is_the_error_energy_over_the_reference_energy_of_the_whole_set(tmp_path: Path) -> None:
    # The almost-grey image has reference logits near 0 and a large error ratio of its own, but carries almost
    # no weight in the whole set's ratio (a text detector's map of a photo without text); the bright one has a
    # large reference and (red and green cancel in the two swapped classes) almost no error.
    colours = {"a.png": (134, 116, 104), "b.png": (0, 237, 255)}
    for name, colour in colours.items():
        Image.new("RGB", (40, 36), colour).save(tmp_path / name)
    model = classifier(tmp_path / "m.onnx", W_SWAPPED, outputs=("logits",))
    ref = classifier(tmp_path / "ref.onnx", outputs=("logits",))
    means = [((np.array(c) / 255 - IMAGENET_MEAN) / IMAGENET_STD).astype(np.float32) for c in colours.values()]
    z, z_ref = [W_SWAPPED.astype(np.float64) @ m for m in means], [W.astype(np.float64) @ m for m in means]
    pooled = np.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(z, z_ref)) / sum((b**2).sum() for b in z_ref))
    per_image = np.mean([np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(z, z_ref)])
    assert per_image > 2 * pooled  # the two definitions differ enough here to tell them apart
    result = evaluate(model, tmp_path, ref=ref, preprocess=PRE)
    assert result.rel_l2["logits"] == pytest.approx(pooled, rel=1e-4)


def test_unlabelled_and_non_classifier(tmp_path: Path) -> None:
    images = red_images(tmp_path / "val", ["000_a.png", "cat.png"])
    model = classifier(tmp_path / "m.onnx")
    result = evaluate(model, images, ref=model, preprocess=PRE)
    assert result.top1 is None and result.top5 is None and result.agreement == 1.0
    features = classifier(tmp_path / "f.onnx", outputs=("pooled",))
    result = evaluate(features, images, ref=features, preprocess=PRE, subset="0:1")
    assert result.images == 1 and result.top1 is None and result.kl is None and result.agreement is None
    assert result.cosine == pytest.approx({"pooled": 1.0})
    assert evaluate(model, images, preprocess=PRE).rel_l2 == {}


def test_a_mask_model_is_judged_by_its_iou_with_the_reference_and_its_spread(tmp_path: Path) -> None:
    """A Keras-style U-Net's output ``[N, H, W, 1]``: ``eval --ref`` gives the masks' IoU and its spread over the
    images (it raised AttributeError: the mask metric had no spread)."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Transpose", ["s"], ["mask"], perm=[0, 2, 3, 1])]
    graph = helper.make_graph(nodes, "unet", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 32, 32])],
                              [helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", 32, 32, 1])],
                              initializer=[numpy_helper.from_array(np.float32([1, 0, 0]).reshape(1, 3, 1, 1), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "unet.onnx")
    path, images = tmp_path / "unet.onnx", red_images(tmp_path / "val", ["a.png", "b.png"])
    result = evaluate(path, images, ref=path, preprocess=PRE)  # red: the mask is all ones
    assert result.task == "mask" and result.metrics == {"mask_iou_ref": 1.0} and result.spread == {"mask_iou_ref": 0.0}


def test_static_batch_is_split_and_padded(tmp_path: Path, labelled: Path) -> None:
    dynamic = evaluate(classifier(tmp_path / "d.onnx"), labelled, preprocess=PRE)
    static = evaluate(classifier(tmp_path / "s.onnx", batch=2), labelled, preprocess=PRE, batch_size=32)
    assert (static.images, static.top1, static.top5) == (dynamic.images, dynamic.top1, dynamic.top5)
    session, _ = make_session(tmp_path / "s.onnx", "cpu")
    x = np.random.default_rng(0).normal(size=(5, 3, 32, 32)).astype(np.float32)
    logits, pooled = run_session(session, {"x": x})
    assert logits.shape == (5, 8) and pooled.shape == (5, 3, 1, 1)
    np.testing.assert_allclose(pooled[:, :, 0, 0], x.mean(axis=(2, 3)), rtol=1e-5, atol=1e-6)


def test_evaluate_errors(tmp_path: Path, labelled: Path) -> None:
    model = classifier(tmp_path / "m.onnx")
    with pytest.raises(ModelError, match="missing.onnx"):
        evaluate(tmp_path / "missing.onnx", labelled)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00not onnx at all")
    with pytest.raises(ModelError, match="garbage.onnx"):
        evaluate(garbage, labelled)
    with pytest.raises(OnnxPruneError, match="output 'logits'.*ten.onnx"):
        evaluate(model, labelled, ref=classifier(tmp_path / "ten.onnx", np.ones((10, 3), np.float32)), preprocess=PRE)
    with pytest.raises(OnnxPruneError, match="outputs of .*differ"):
        evaluate(model, labelled, ref=classifier(tmp_path / "one.onnx", outputs=("logits",)))
    with pytest.raises(CalibrationError, match="set the crop"):
        evaluate(model, labelled)  # default 224 crop on a 32x32 model
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="no images"):
        evaluate(model, tmp_path / "empty")


def test_format_table(tmp_path: Path, labelled: Path) -> None:
    model = classifier(tmp_path / "m.onnx")
    results = {
        "original": evaluate(model, labelled, ref=model, preprocess=PRE),
        "pruned": EvalResult(images=3, provider="CPUExecutionProvider", top1=0.25, rel_l2={"logits": 0.5},
                             spread={"top1": 0.25}),
    }
    console = Console(record=True, width=200)
    console.print(format_table(results))
    text = console.export_text()
    for expected in ("rel-L2 logits", "cos pooled", "original", "pruned", "33.33% ± 27.2%", "100.00% ± 0.0%",
                     "25.00% ± 25.0%", "0.5"):
        assert expected in text


def test_a_detector_table_shows_its_metrics_not_a_classifier_s() -> None:
    """A detector's eval table leads with mAP50/mAP50-95 and has no classifier columns of '-'."""
    result = EvalResult(images=4, provider="CPUExecutionProvider", rel_l2={"output0": 0.1}, cosine={"output0": 0.99},
                        task="detect", metrics={"mAP50_ref": 0.91, "mAP50-95_ref": 0.72}, spread={"mAP50-95_ref": 0.0241})
    console = Console(record=True, width=200)
    console.print(format_table({"pruned": result}))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "model" in line)
    assert [w for w in header.replace("┃", " ").split() if w in ("mAP50_ref", "mAP50-95_ref", "top-1", "KL")] == [
        "mAP50_ref", "mAP50-95_ref"]
    assert "0.72 ± 0.024" in text and "0.91 ±" not in text  # a score's spread over the images, where known
    assert "Fidelity (detect)" in text


def test_sessions_and_specs(tmp_path: Path) -> None:
    model = classifier(tmp_path / "m.onnx")
    assert "CPUExecutionProvider" in ort_runtime.available_providers()
    assert make_session(model, "cpu", threads=1)[1] == "CPUExecutionProvider"
    assert make_session(onnx.load(model), "auto")[1] == make_session(model.read_bytes())[1]
    assert model_input_specs(model) == [("x", ["batch", 3, 32, 32], np.dtype(np.float32))]
    assert model_output_names(model) == ["logits", "pooled"]
    proto = onnx.load(model)  # an old-style model listing its weights among the inputs
    proto.graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 3]))
    assert [name for name, _, _ in model_input_specs(proto)] == ["x"]
    with pytest.raises(OnnxPruneError, match="unknown provider .*: use auto, cpu"):
        make_session(model, "rocm")


@pytest.mark.skipif("CUDAExecutionProvider" in ort_runtime.available_providers(), reason="needs a CPU-only build")
def test_cuda_on_cpu_only_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = classifier(tmp_path / "m.onnx")
    with pytest.raises(OnnxPruneError, match="CUDAExecutionProvider is not available.*the cpu provider"):
        make_session(model, "cuda")
    # onnxruntime-gpu without working CUDA libraries lists CUDA but silently runs on CPU.
    monkeypatch.setattr(ort_runtime, "available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.warns(UserWarning), pytest.raises(OnnxPruneError, match="fell back to CPUExecutionProvider"):
        make_session(model, "cuda")
    with pytest.warns(UserWarning):
        assert make_session(model, "auto")[1] == "CPUExecutionProvider"
