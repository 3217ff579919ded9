"""Shared fixtures: zoo models exported once per test session, small and with random (default-init) weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

from onnxprune.analysis import Analysis, analyze
from tests.onnx_builders import export_torch

ZOO_INPUT = (1, 3, 64, 64)


def _vgg11_features() -> nn.Module:
    """VGG-11's real conv stack and 7x7 pool (models.vgg) with a small classifier: the full 4096-wide
    classifier makes export + analysis take ~20 s, and the conv/Flatten→Gemm structure is the same."""
    from models.vgg import _VGG11, VGG

    model = VGG(_VGG11)
    model.classifier = nn.Sequential(nn.Linear(512 * 7 * 7, 32), nn.ReLU(True), nn.Linear(32, 10))
    return model


def _builders() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    from models.mobilenet_v2 import mobilenet_v2
    from models.mobilenet_v3 import mobilenet_v3_small
    from models.resnet import resnet34, resnet50
    from models.vgg import vgg11

    return {
        "mobilenet_v2": (mobilenet_v2, ZOO_INPUT),
        "resnet34": (resnet34, ZOO_INPUT),
        "resnet50": (resnet50, ZOO_INPUT),
        "mobilenet_v3_small": (mobilenet_v3_small, ZOO_INPUT),
        "vgg11_features": (_vgg11_features, (1, 3, 224, 224)),  # 7x7 adaptive pool needs 224 input
        "vgg11": (vgg11, (1, 3, 224, 224)),
    }


class Zoo:
    """Exports a zoo architecture (default torch init = random weights) on first use and caches it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._paths: dict[str, Path] = {}
        self._analyses: dict[str, Analysis] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            build, shape = _builders()[name]
            torch.manual_seed(0)
            self._paths[name] = export_torch(build(), self.root / f"{name}.onnx", shape)
        return self._paths[name]

    def model(self, name: str) -> onnx.ModelProto:
        return onnx.load(str(self.path(name)))

    def analysis(self, name: str) -> Analysis:
        if name not in self._analyses:
            self._analyses[name] = analyze(self.model(name))
        return self._analyses[name]


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    return Zoo(tmp_path_factory.mktemp("zoo"))


class Tiny:
    """The tiny MobileNetV2-like model (dynamic batch, 32x32) and 64 random calibration samples."""

    def __init__(self, root: Path) -> None:
        import numpy as np

        from tests.onnx_builders import export_tiny

        self.path = export_tiny(root / "tiny.onnx")
        self.model = onnx.load(str(self.path))
        self.x = np.random.default_rng(0).standard_normal((64, 3, 32, 32)).astype(np.float32)
        self.calib = root / "calib.npy"
        np.save(self.calib, self.x)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    return Tiny(tmp_path_factory.mktemp("tiny"))
