"""The structure builders (YOLO-style detector, U-Net, DGCNN), in miniature: they export, `analyze`
finds their Split/Concat/ConvTranspose/EdgeConv groups, and `compress --target-ratio 0.85` writes a
model that passes onnx.checker and runs in onnxruntime with the same inputs and outputs, at ≤ 86 % of
the MACs (DGCNN's calibration data is a .npz keyed by its input name)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from typer.testing import CliRunner

from models.build import SPECS, Spec, build, export_model, randomise
from models.dgcnn import DGCNN
from models.unet import UNet
from models.yolo import Detector
from onnxprune.analysis import analyze
from onnxprune.cli import app
from tests.onnx_builders import session

runner = CliRunner()
TINY = {
    "yolo_detector": Spec(lambda: Detector(classes=2, w=4), (1, 3, 64, 64), "images", "output0"),
    "unet": Spec(lambda: UNet(classes=2, widths=(4, 8, 16)), (1, 3, 32, 32), "input", "mask"),
    "dgcnn": Spec(lambda: DGCNN(classes=5, k=4, widths=(8, 8, 16, 16), emb=32), (1, 3, 32), "points", "logits"),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("builders")
    out = {}
    for name, spec in TINY.items():
        model = randomise(spec.factory(), input_shape=spec.input_shape)
        out[name] = export_model(model, d / f"{name}.onnx", spec=spec)
    return out


def test_registered_builders_build_at_their_input_size() -> None:
    for name in TINY:
        spec = SPECS[name]
        model = build(name)
        with torch.no_grad():
            y = model(torch.zeros(2, *spec.input_shape[1:]))
        assert y.shape[0] == 2 and torch.isfinite(y).all()


def test_groups_of_each_structure(tiny_models: dict[str, Path]) -> None:
    yolo = {g.name: g for g in analyze(onnx.load(str(tiny_models["yolo_detector"]))).groups}
    pieces = [n for n in yolo if n.endswith("]")]  # the C2f cv1 outputs, one group per Split piece
    assert len(pieces) >= 16 and all(yolo[n].prunable for n in pieces)
    sppf = next(g for n, g in yolo.items() if "SPPF" in n or "p5.2/cv1" in n)
    assert max(len(v) for v in sppf.offsets.values()) == 4  # cv1 and its three max-pools, one Concat
    unet = analyze(onnx.load(str(tiny_models["unet"])))
    ups = [g for g in unet.groups if g.name.startswith("/up.")]
    assert ups and all(g.prunable for g in ups)  # ConvTranspose producers, read through the skip Concat
    assert any(c.kind == "conv_transpose" for g in unet.groups for c in g.consumers)
    dgcnn = {g.name: g for g in analyze(onnx.load(str(tiny_models["dgcnn"]))).groups}
    assert "a product of two computed tensors sums over these channels" in dgcnn["/edge.0/edge.0.0/Conv"].reason
    assert dgcnn["/edge.3/edge.3.0/Conv"].prunable and dgcnn["/conv5/conv5.0/Conv"].prunable


@pytest.mark.parametrize("name", list(TINY))
def test_compress_each_structure(tiny_models: dict[str, Path], tmp_path: Path, name: str) -> None:
    spec = TINY[name]
    path = tiny_models[name]
    calib = tmp_path / "calib.npz"
    x = np.random.default_rng(0).standard_normal((8, *spec.input_shape[1:])).astype(np.float32)
    np.savez(calib, **{spec.input_name: x})
    out, report = tmp_path / "small.onnx", tmp_path / "r.json"
    result = runner.invoke(app, ["compress", str(path), "-o", str(out), "--calib", str(calib), "--target-ratio", "0.85",
                                 "--round-to", "1", "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["macs_after"] <= 0.86 * data["macs_before"] and data["layers"]
    onnx.checker.check_model(str(out))
    before, after = session(path), session(out)
    assert [(i.name, i.type, i.shape) for i in after.get_inputs()] == [(i.name, i.type, i.shape) for i in before.get_inputs()]
    assert [(o.name, o.type) for o in after.get_outputs()] == [(o.name, o.type) for o in before.get_outputs()]
    held_out = np.random.default_rng(1).standard_normal((8, *spec.input_shape[1:])).astype(np.float32)
    want, got = before.run(None, {spec.input_name: held_out})[0], after.run(None, {spec.input_name: held_out})[0]
    # measured 0.25-0.40 (random weights); a producer's bias or BatchNormalization sliced one channel off its
    # weights gives 0.82-1.7
    assert got.shape == want.shape and np.linalg.norm(got - want) <= 0.5 * np.linalg.norm(want)
