"""Build zoo models by name and export them to ONNX; ``python -m models NAME -o out.onnx``."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from models.mobilenet_v2 import mobilenet_v2
from models.mobilenet_v3 import mobilenet_v3_small
from models.resnet import resnet34, resnet50
from models.vgg import vgg11
from onnxprune.errors import ModelError, OnnxPruneError

_RANDOM: dict[str, Callable[[], nn.Module]] = {
    "resnet34": resnet34,
    "resnet50": resnet50,
    "mobilenet_v3_small": mobilenet_v3_small,
    "vgg11": vgg11,
}
MODEL_NAMES: tuple[str, ...] = ("mobilenet_v2", *_RANDOM)
WEIGHTS = ("imagenet", "random")
INPUT_SHAPE = (1, 3, 224, 224)
SEED = 0


def default_weights(name: str) -> str:
    """``imagenet`` for MobileNetV2 (the only model with real weights), ``random`` otherwise."""
    return "imagenet" if name == "mobilenet_v2" else "random"


@torch.no_grad()
def randomise(model: nn.Module, seed: int = SEED, calib_batch: int = 4) -> nn.Module:
    """Seeded, numerically sane random weights.

    Conv/Linear get Kaiming (fan-in) weights and small biases, BN gets affine ~U(0.5, 1.5) / U(-0.1, 0.1);
    BN running stats are then set from one train-mode pass over Gaussian noise, so every BN sees
    roughly normalised activations in eval mode (non-trivial mean/var, nothing explodes or vanishes).
    """
    torch.manual_seed(seed)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
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
        model.train()(torch.randn(calib_batch, *INPUT_SHAPE[1:]))
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
    model = mobilenet_v2() if name == "mobilenet_v2" else _RANDOM[name]()
    return randomise(model)


def export_model(model: nn.Module, path: str | os.PathLike[str], opset: int = 17) -> Path:
    """Export ``model`` to ``path`` atomically (input ``input`` NCHW 224x224, output ``logits``, dynamic batch)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter is chosen on purpose
            torch.onnx.export(
                model.eval(),
                (torch.zeros(INPUT_SHAPE),),
                tmp,
                dynamo=False,
                opset_version=opset,
                input_names=["input"],
                output_names=["logits"],
                dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
                do_constant_folding=True,
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def export_onnx(name: str, path: str | os.PathLike[str], weights: str | None = None, opset: int = 17) -> Path:
    """Build model ``name`` with ``weights`` (default per ``default_weights``) and export it to ``path``."""
    return export_model(build(name, weights), path, opset)


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
