"""A YOLOv8-style detector in miniature (random weights, for structure): Conv-BN-SiLU, C2f blocks
(Split / bottlenecks / Concat), SPPF (three max-pools concatenated), an FPN/PAN neck with nearest
upsampling (Resize) and skip Concats, and a decoupled head whose per-scale outputs are flattened and
concatenated into one ``(batch, 4 + classes, anchors)`` tensor, as Ultralytics exports it."""

from __future__ import annotations

import torch
from torch import nn


def conv(c_in: int, c_out: int, k: int = 1, s: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, s, k // 2, bias=False), nn.BatchNorm2d(c_out), nn.SiLU())


class Bottleneck(nn.Module):
    def __init__(self, c: int, shortcut: bool) -> None:
        super().__init__()
        self.cv1, self.cv2, self.add = conv(c, c, 3), conv(c, c, 3), shortcut

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class C2f(nn.Module):
    """cv1 → split in halves → n bottlenecks on the second half → concat of all pieces → cv2."""

    def __init__(self, c_in: int, c_out: int, n: int = 1, shortcut: bool = False) -> None:
        super().__init__()
        self.c = c_out // 2
        self.cv1 = conv(c_in, 2 * self.c)
        self.cv2 = conv((2 + n) * self.c, c_out)
        self.m = nn.ModuleList(Bottleneck(self.c, shortcut) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = list(self.cv1(x).split((self.c, self.c), 1))
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


class C2fTwoConvs(nn.Module):
    """A ``C2f`` with its first conv as one conv a half (Torch-Pruning's ``C2f_v2`` for Ultralytics' C2f): the same
    outputs, no Split, so pruning may narrow the halves apart and the module follows (``apply_manifest``)."""

    def __init__(self, c2f: C2f) -> None:
        super().__init__()
        c, (first, norm, _) = c2f.c, c2f.cv1
        self.cv0, self.cv1 = (_rows(first, norm, slice(i * c, (i + 1) * c)) for i in range(2))
        self.m, self.cv2 = c2f.m, c2f.cv2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv0(x), self.cv1(x)]
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


def _rows(first: nn.Conv2d, norm: nn.BatchNorm2d, rows: slice) -> nn.Sequential:
    """Conv-BN-SiLU computing output channels ``rows`` of ``first`` and ``norm``."""
    part = conv(first.in_channels, rows.stop - rows.start, first.kernel_size[0], first.stride[0])
    part[0].weight.data.copy_(first.weight.data[rows])
    for name in ("weight", "bias", "running_mean", "running_var"):
        getattr(part[1], name).data.copy_(getattr(norm, name).data[rows])
    return part


def two_convs(module: nn.Module) -> nn.Module:
    """``module`` with every ``C2f`` replaced by its ``C2fTwoConvs`` (in place; returned)."""
    for name, child in module.named_children():
        setattr(module, name, C2fTwoConvs(child) if isinstance(child, C2f) else two_convs(child))
    return module


class SPPF(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.cv1, self.cv2 = conv(c_in, c_in // 2), conv(c_in // 2 * 4, c_out)
        self.pool = nn.MaxPool2d(5, 1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv1(x)]
        y.extend(self.pool(y[-1]) for _ in range(3))
        return self.cv2(torch.cat(y, 1))


class Detector(nn.Module):
    """Backbone (P3, P4, P5) → top-down FPN → bottom-up PAN → per-scale box and class branches."""

    def __init__(self, classes: int = 8, w: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(conv(3, w, 3, 2), conv(w, 2 * w, 3, 2), C2f(2 * w, 2 * w, 1, True))
        self.p3 = nn.Sequential(conv(2 * w, 4 * w, 3, 2), C2f(4 * w, 4 * w, 2, True))
        self.p4 = nn.Sequential(conv(4 * w, 8 * w, 3, 2), C2f(8 * w, 8 * w, 2, True))
        self.p5 = nn.Sequential(conv(8 * w, 8 * w, 3, 2), C2f(8 * w, 8 * w, 1, True), SPPF(8 * w, 8 * w))
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.td4, self.td3 = C2f(16 * w, 8 * w), C2f(12 * w, 4 * w)
        self.down3, self.bu4 = conv(4 * w, 4 * w, 3, 2), C2f(12 * w, 8 * w)
        self.down4, self.bu5 = conv(8 * w, 8 * w, 3, 2), C2f(16 * w, 8 * w)
        self.box = nn.ModuleList(nn.Sequential(conv(c, 4 * w, 3), nn.Conv2d(4 * w, 4, 1)) for c in (4 * w, 8 * w, 8 * w))
        self.cls = nn.ModuleList(nn.Sequential(conv(c, 4 * w, 3), nn.Conv2d(4 * w, classes, 1))
                                 for c in (4 * w, 8 * w, 8 * w))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p3 = self.p3(self.stem(x))
        p4 = self.p4(p3)
        p5 = self.p5(p4)
        t4 = self.td4(torch.cat([self.up(p5), p4], 1))
        n3 = self.td3(torch.cat([self.up(t4), p3], 1))
        n4 = self.bu4(torch.cat([self.down3(n3), t4], 1))
        n5 = self.bu5(torch.cat([self.down4(n4), p5], 1))
        outs = [torch.cat([box(f), cls(f)], 1).flatten(2) for f, box, cls in zip((n3, n4, n5), self.box, self.cls)]
        return torch.cat(outs, 2)


def yolo_detector() -> Detector:
    return Detector()
