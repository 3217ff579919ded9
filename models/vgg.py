"""VGG-11 without batch norm, torchvision layout (``features``, ``avgpool``, ``classifier``)."""

from __future__ import annotations

import torch
from torch import nn

_VGG11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG(nn.Module):
    """Conv/ReLU/max-pool stack -> 7x7 adaptive pool -> flatten -> three Linear layers."""

    def __init__(self, cfg: list[int | str], num_classes: int = 1000, dropout: float = 0.5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_ch = 3
        for v in cfg:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(in_ch, int(v), 3, padding=1), nn.ReLU(inplace=True)]
                in_ch = int(v)
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(True),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg11() -> VGG:
    """VGG-11 (configuration "A"), no batch norm."""
    return VGG(_VGG11)
