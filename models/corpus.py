"""Architectures of the export classes the third-party corpus makes here (random weights, for structure, time and
memory): the way U-Nets, CenterNet-style face detectors, NMS-free heads, dense per-stride face heads and CRNN
readers are written in PyTorch, so that ``torch.onnx.export`` writes what their users' exports hold."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models._layers import conv_norm_act
from models.unet import UNet


def _resize(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return F.interpolate(t, size=like.shape[2:], mode="bilinear", align_corners=False)


class SkipSizedUNet(nn.Module):
    """U²-Net's way: every decoder level resized to its skip's size (``interpolate(size=skip.shape[2:])``), a fused
    sigmoid map and side outputs at the input's size."""

    def __init__(self, widths: tuple[int, ...] = (16, 32, 64, 128)) -> None:
        super().__init__()
        self.enc = nn.ModuleList(conv_norm_act(c_in, c) for c_in, c in zip((3, *widths[:-1]), widths))
        self.dec = nn.ModuleList(conv_norm_act(2 * c, c) for c in reversed(widths[:-1]))
        self.cut = nn.ModuleList(nn.Conv2d(c, c2, 1) for c, c2 in zip(reversed(widths[1:]), reversed(widths[:-1])))
        self.sides = nn.ModuleList(nn.Conv2d(c, 1, 3, padding=1) for c in reversed(widths[:-1]))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        skips = []
        for i, block in enumerate(self.enc):
            x = block(x if i == 0 else F.max_pool2d(x, 2, ceil_mode=True))
            skips.append(x)
        sides = []
        for cut, dec, side, skip in zip(self.cut, self.dec, self.sides, reversed(skips[:-1])):
            x = dec(torch.cat([_resize(cut(x), skip), skip], 1))
            sides.append(_resize(side(x), skips[0]))
        fused = sum(sides)
        return tuple(torch.sigmoid(s) for s in (fused, *sides))


class ChannelsLastUNet(nn.Module):
    """A Keras-style U-Net as tf2onnx writes it: NHWC in and out, ConvTranspose up-sampling, a sigmoid mask."""

    def __init__(self, widths: tuple[int, ...] = (48, 96, 192, 384)) -> None:
        super().__init__()
        self.net = UNet(classes=1, widths=widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.net(x.permute(0, 3, 1, 2))).permute(0, 2, 3, 1)


class CenterFaceLike(nn.Module):
    """CenterFace's layout: a strided backbone, an FPN up to stride 4, and four maps there: a sigmoid heat map, box
    scales, offsets and ten landmark coordinates."""

    def __init__(self, widths: tuple[int, ...] = (16, 24, 32, 64, 96)) -> None:
        super().__init__()
        self.stages = nn.ModuleList(conv_norm_act(c_in, c, stride=2) for c_in, c in zip((3, *widths[:-1]), widths))
        self.lateral = nn.ModuleList(nn.Conv2d(c, 24, 1) for c in widths[1:])
        self.smooth = conv_norm_act(24, 24)
        self.heads = nn.ModuleList(nn.Conv2d(24, c, 1) for c in (1, 2, 2, 10))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feats = []
        for stage in self.stages:
            x = stage(x)
            feats.append(x)
        top = self.lateral[-1](feats[-1])
        for lateral, feat in zip(reversed(self.lateral[:-1]), reversed(feats[1:-1])):
            top = F.interpolate(top, scale_factor=2.0, mode="nearest") + lateral(feat)
        y = self.smooth(top)
        heat, scale, offset, marks = (head(y) for head in self.heads)
        return torch.sigmoid(heat), scale, offset, marks


class NmsFreeDetector(nn.Module):
    """A YOLOv10-style end-to-end head in miniature: per cell 4 box values and C class scores, the best class per
    cell, the K best cells by TopK, rows of x1, y1, x2, y2, score, class."""

    def __init__(self, classes: int = 5, k: int = 50) -> None:
        super().__init__()
        self.k, self.classes = k, classes
        self.body = nn.Sequential(conv_norm_act(3, 16, stride=2), conv_norm_act(16, 32, stride=2),
                                  conv_norm_act(32, 64, stride=2), conv_norm_act(64, 64))
        self.head = nn.Conv2d(64, 4 + classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.body(x)).flatten(2).transpose(1, 2)  # [N, cells, 4 + C]
        box = torch.sigmoid(y[..., :4]) * x.shape[-1]
        xyxy = torch.cat([box[..., :2] - box[..., 2:] / 4, box[..., :2] + box[..., 2:] / 4], -1)
        score, label = torch.sigmoid(y[..., 4:]).max(-1, keepdim=True)
        rows = torch.cat([xyxy, score, label.float()], -1)
        index = score.squeeze(-1).topk(self.k, dim=1).indices
        return torch.gather(rows, 1, index.unsqueeze(-1).expand(-1, -1, 6))


class DenseFaceHead(nn.Module):
    """SCRFD's outputs: per stride 8, 16, 32 and two anchors a cell, the scores ``[N, 2·HW, 1]``, box distances
    ``[N, 2·HW, 4]`` and keypoints ``[N, 2·HW, 10]``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv_norm_act(3, 16, stride=2), conv_norm_act(16, 32, stride=2),
                                  conv_norm_act(32, 32, stride=2))
        self.down = nn.ModuleList([conv_norm_act(32, 48, stride=2), conv_norm_act(48, 64, stride=2)])
        self.heads = nn.ModuleList(nn.Conv2d(c, 2 * (1 + 4 + 10), 1) for c in (32, 48, 64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        feats = [self.stem(x)]
        for down in self.down:
            feats.append(down(feats[-1]))
        outs = []
        for head, feat in zip(self.heads, feats):
            y = head(feat).flatten(2).transpose(1, 2).reshape(x.shape[0], -1, 15)
            outs.append((torch.sigmoid(y[..., :1]), y[..., 1:5], y[..., 5:]))
        return tuple(o[i] for i in range(3) for o in outs)


class CRNN(nn.Module):
    """A CNN + bidirectional LSTM CTC reader: a gray line image, the CNN's columns as the time steps,
    ``[T, N, classes]`` log-probabilities (time-major, as PyTorch's CTC loss wants them)."""

    def __init__(self, classes: int = 40) -> None:
        super().__init__()
        self.cnn = nn.Sequential(conv_norm_act(1, 32), nn.MaxPool2d(2), conv_norm_act(32, 64), nn.MaxPool2d(2),
                                 conv_norm_act(64, 96), nn.MaxPool2d((2, 1)), conv_norm_act(96, 128),
                                 nn.MaxPool2d((4, 1)))
        self.rnn = nn.LSTM(128, 64, bidirectional=True)
        self.fc = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cnn(x).squeeze(2).permute(2, 0, 1)  # [T, N, 128]
        y, _ = self.rnn(y)
        return self.fc(y).log_softmax(-1)
