"""MobileNetV3-Small with torchvision's module layout (hardswish, Conv2d squeeze-excite, depthwise convs)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from models._layers import conv_norm_act, make_divisible

_BN = {"eps": 0.001, "momentum": 0.01}


class BlockConfig(NamedTuple):
    """One bottleneck: input, kernel, expanded and output channels, squeeze-excite, hardswish, stride."""

    in_ch: int
    kernel: int
    exp_ch: int
    out_ch: int
    use_se: bool
    use_hs: bool
    stride: int


_SMALL = [
    BlockConfig(16, 3, 16, 16, True, False, 2),
    BlockConfig(16, 3, 72, 24, False, False, 2),
    BlockConfig(24, 3, 88, 24, False, False, 1),
    BlockConfig(24, 5, 96, 40, True, True, 2),
    BlockConfig(40, 5, 240, 40, True, True, 1),
    BlockConfig(40, 5, 240, 40, True, True, 1),
    BlockConfig(40, 5, 120, 48, True, True, 1),
    BlockConfig(48, 5, 144, 48, True, True, 1),
    BlockConfig(48, 5, 288, 96, True, True, 2),
    BlockConfig(96, 5, 576, 96, True, True, 1),
    BlockConfig(96, 5, 576, 96, True, True, 1),
]


class SqueezeExcitation(nn.Module):
    """Channel gate: global pool -> fc1 (1x1 conv) -> ReLU -> fc2 (1x1 conv) -> Hardsigmoid -> scale input."""

    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.fc2(self.activation(self.fc1(self.avgpool(x))))
        return self.scale_activation(scale) * x


class InvertedResidual(nn.Module):
    """Optional 1x1 expand -> depthwise kxk -> optional SE -> linear 1x1 project, skip when shapes match."""

    def __init__(self, cfg: BlockConfig) -> None:
        super().__init__()
        self.use_res_connect = cfg.stride == 1 and cfg.in_ch == cfg.out_ch
        act = nn.Hardswish if cfg.use_hs else nn.ReLU
        layers: list[nn.Module] = []
        if cfg.exp_ch != cfg.in_ch:
            layers.append(conv_norm_act(cfg.in_ch, cfg.exp_ch, kernel=1, act=act, norm_kwargs=_BN))
        layers.append(
            conv_norm_act(cfg.exp_ch, cfg.exp_ch, cfg.kernel, cfg.stride, groups=cfg.exp_ch, act=act, norm_kwargs=_BN)
        )
        if cfg.use_se:
            layers.append(SqueezeExcitation(cfg.exp_ch, make_divisible(cfg.exp_ch // 4)))
        layers.append(conv_norm_act(cfg.exp_ch, cfg.out_ch, kernel=1, act=None, norm_kwargs=_BN))
        self.block = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out + x if self.use_res_connect else out


class MobileNetV3(nn.Module):
    """MobileNetV3: ``features`` -> ``avgpool`` -> ``classifier`` (Linear, Hardswish, Dropout, Linear)."""

    def __init__(
        self, blocks: list[BlockConfig], last_channel: int, num_classes: int = 1000, dropout: float = 0.2
    ) -> None:
        super().__init__()
        first, last_in = blocks[0].in_ch, blocks[-1].out_ch
        last_out = 6 * last_in
        self.features = nn.Sequential(
            conv_norm_act(3, first, stride=2, act=nn.Hardswish, norm_kwargs=_BN),
            *(InvertedResidual(cfg) for cfg in blocks),
            conv_norm_act(last_in, last_out, kernel=1, act=nn.Hardswish, norm_kwargs=_BN),
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(
            nn.Linear(last_out, last_channel),
            nn.Hardswish(inplace=True),
            nn.Dropout(dropout, inplace=True),
            nn.Linear(last_channel, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def mobilenet_v3_small() -> MobileNetV3:
    """MobileNetV3-Small (width 1.0, 1024-wide head)."""
    return MobileNetV3(_SMALL, 1024)
