"""A U-Net-style encoder-decoder (random weights, for structure): double Conv-BN-ReLU blocks, max-pool
down, ConvTranspose 2×2 up, skip Concats, a 1×1 per-pixel classifier."""

from __future__ import annotations

import torch
from torch import nn

from models._layers import conv_norm_act


def double(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(conv_norm_act(c_in, c_out), conv_norm_act(c_out, c_out))


class UNet(nn.Module):
    def __init__(self, classes: int = 3, widths: tuple[int, ...] = (16, 32, 64, 128)) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        c_in = 3
        for c in widths:
            self.down.append(double(c_in, c))
            c_in = c
        self.pool = nn.MaxPool2d(2)
        self.up = nn.ModuleList(nn.ConvTranspose2d(c, c // 2, 2, 2) for c in reversed(widths[1:]))
        self.dec = nn.ModuleList(double(c, c // 2) for c in reversed(widths[1:]))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else self.pool(x))
            skips.append(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips[:-1])):
            x = dec(torch.cat([up(x), skip], 1))
        return self.head(x)


def unet() -> UNet:
    return UNet()
