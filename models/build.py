"""Build zoo models by name and export them to ONNX; ``python -m models NAME -o out.onnx``."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from models.dgcnn import POINTS, dgcnn
from models.mobilenet_v2 import mobilenet_v2
from models.mobilenet_v3 import mobilenet_v3_small
from models.resnet import resnet34, resnet50
from models.unet import unet
from models.vgg import vgg11
from models.yolo import yolo_detector
from onnxprune.errors import ModelError, OnnxPruneError

INPUT_SHAPE = (1, 3, 224, 224)


@dataclass(frozen=True)
class Spec:
    """How a zoo model is exported: its input's shape (batch 1, dynamic in the file) and the names."""

    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...] = INPUT_SHAPE
    input_name: str = "input"
    output_name: str = "logits"


_RANDOM: dict[str, Spec] = {
    "resnet34": Spec(resnet34),
    "resnet50": Spec(resnet50),
    "mobilenet_v3_small": Spec(mobilenet_v3_small),
    "vgg11": Spec(vgg11),
    "yolo_detector": Spec(yolo_detector, (1, 3, 256, 256), "images", "output0"),
    "unet": Spec(unet, (1, 3, 128, 128), "input", "mask"),
    "dgcnn": Spec(dgcnn, (1, 3, POINTS), "points", "logits"),
}
SPECS: dict[str, Spec] = {"mobilenet_v2": Spec(mobilenet_v2), **_RANDOM}
MODEL_NAMES: tuple[str, ...] = tuple(SPECS)
WEIGHTS = ("imagenet", "random")
SEED = 0


def default_weights(name: str) -> str:
    """``imagenet`` for MobileNetV2 (the only model with real weights), ``random`` otherwise."""
    return "imagenet" if name == "mobilenet_v2" else "random"


@torch.no_grad()
def randomise(model: nn.Module, seed: int = SEED, calib_batch: int = 4,
              input_shape: tuple[int, ...] = INPUT_SHAPE) -> nn.Module:
    """Seeded, numerically sane random weights.

    Conv/Linear get Kaiming (fan-in) weights and small biases, BN gets affine ~U(0.5, 1.5) / U(-0.1, 0.1);
    BN running stats are then set from one train-mode pass over Gaussian noise, so every BN sees
    roughly normalised activations in eval mode (non-trivial mean/var, nothing explodes or vanishes).
    """
    torch.manual_seed(seed)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in model.modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                nn.init.uniform_(m.bias, -0.1, 0.1)
    for bn in bns:
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.1, 0.1)
    if bns:
        momenta = [bn.momentum for bn in bns]
        for bn in bns:
            bn.reset_running_stats()
            bn.momentum = None  # cumulative average: after one batch, running stats == batch stats
        model.train()(torch.randn(calib_batch, *input_shape[1:]))
        for bn, momentum in zip(bns, momenta):
            bn.momentum = momentum
    return model.eval()


def build(name: str, weights: str | None = None) -> nn.Module:
    """Model ``name`` (one of ``MODEL_NAMES``) in eval mode; ``weights`` is ``imagenet`` or ``random``."""
    if name not in MODEL_NAMES:
        raise ModelError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    weights = weights or default_weights(name)
    if weights not in WEIGHTS:
        raise ModelError(f"unknown weights {weights!r} for {name}; choose one of {', '.join(WEIGHTS)}")
    if weights == "imagenet":
        if name != "mobilenet_v2":
            raise ModelError(f"no ImageNet weights ship for {name}; use --weights random")
        return mobilenet_v2(pretrained=True).eval()
    spec = SPECS[name]
    return randomise(spec.factory(), input_shape=spec.input_shape)


def export_model(model: nn.Module, path: str | os.PathLike[str], opset: int = 17, spec: Spec = SPECS["mobilenet_v2"]) -> Path:
    """Export ``model`` to ``path`` atomically (input and output names and the input shape from ``spec``:
    ``input`` NCHW 224x224 and ``logits`` by default; dynamic batch)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter is chosen on purpose
            torch.onnx.export(
                model.eval(),
                (torch.zeros(spec.input_shape),),
                tmp,
                dynamo=False,
                opset_version=opset,
                input_names=[spec.input_name],
                output_names=[spec.output_name],
                dynamic_axes={spec.input_name: {0: "batch"}, spec.output_name: {0: "batch"}},
                do_constant_folding=True,
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def export_onnx(name: str, path: str | os.PathLike[str], weights: str | None = None, opset: int = 17) -> Path:
    """Build model ``name`` with ``weights`` (default per ``default_weights``) and export it to ``path``."""
    return export_model(build(name, weights), path, opset, SPECS[name])


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: export one zoo model and print its path."""
    parser = argparse.ArgumentParser(prog="python -m models", description="Export a zoo model to ONNX.")
    parser.add_argument("name", choices=MODEL_NAMES)
    parser.add_argument("-o", "--output", required=True, type=Path, help="ONNX file to write")
    parser.add_argument("--weights", choices=WEIGHTS, help="default: imagenet for mobilenet_v2, random otherwise")
    parser.add_argument("--opset", type=int, default=17)
    args = parser.parse_args(argv)
    try:
        print(export_onnx(args.name, args.output, args.weights, args.opset))
    except OnnxPruneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
