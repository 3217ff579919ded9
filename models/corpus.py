"""Architectures of the export classes the third-party corpus makes here (random weights, for structure, time and
memory): the way U-Nets, CenterNet-style face detectors, NMS-free heads, dense per-stride face heads, CRNN readers,
and the ConvNeXt, ShuffleNetV2, GhostNet, DenseNet, RegNetY, GoogLeNet, MobileViT, VoVNetV2 and RepVGG (as trained)
layouts are written in PyTorch, so that ``torch.onnx.export`` writes what their users' exports hold."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models._layers import conv_norm_act, make_divisible
from models.mobilenet_v3 import SqueezeExcitation
from models.unet import UNet


def _resize(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return F.interpolate(t, size=like.shape[2:], mode="bilinear", align_corners=False)


class _PooledClassifier(nn.Module):
    """``features``, global average pooling and a linear classifier to 1000 classes from its ``channels``."""

    def __init__(self, features: nn.Sequential, channels: int) -> None:
        super().__init__()
        self.features, self.fc = features, nn.Linear(channels, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


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


class _ConvNeXtBlock(nn.Module):
    """Depthwise 7×7, then channels-last: LayerNorm over the channels and a Linear MLP, a layer scale, the residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))
        self.gamma = nn.Parameter(torch.full((c,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.mlp(self.norm(self.dw(x).permute(0, 2, 3, 1))) * self.gamma).permute(0, 3, 1, 2)


class _ChannelNorm(nn.LayerNorm):
    """ConvNeXt's LayerNorm of an NCHW map over its channels (through channels-last)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXtLike(nn.Module):
    """ConvNeXt's layout: a 4×4 patch stem, stages of ``_ConvNeXtBlock`` joined by LayerNorm + 2×2 strided convs,
    a pooled LayerNorm head (the MLPs are MatMuls on channels-last tensors)."""

    def __init__(self, dims: tuple[int, ...] = (48, 96, 192, 384), depths: tuple[int, ...] = (2, 2, 4, 2)) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, stride=4), _ChannelNorm(dims[0])]
        for i, (d, n) in enumerate(zip(dims, depths)):
            if i:
                layers += [_ChannelNorm(dims[i - 1]), nn.Conv2d(dims[i - 1], d, 2, stride=2)]
            layers += [_ConvNeXtBlock(d) for _ in range(n)]
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class _ShuffleUnit(nn.Module):
    """ShuffleNetV2's unit: half the channels through a 1×1 / depthwise 3×3 / 1×1 branch (all of them, and a second
    branch, where it strides), concatenated and shuffled across the two halves."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        half = c_out // 2
        self.stride = stride
        self.main = nn.Sequential(conv_norm_act(c_in if stride > 1 else c_in // 2, half, 1),
                                  conv_norm_act(half, half, stride=stride, groups=half, act=None),
                                  conv_norm_act(half, half, 1))
        self.side = nn.Sequential(conv_norm_act(c_in, c_in, stride=stride, groups=c_in, act=None),
                                  conv_norm_act(c_in, half, 1)) if stride > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.side is None:
            keep, x = x.chunk(2, dim=1)
            y = torch.cat((keep, self.main(x)), 1)
        else:
            y = torch.cat((self.side(x), self.main(x)), 1)
        n, c, h, w = y.shape
        return y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)


class ShuffleNetLike(_PooledClassifier):
    """ShuffleNetV2 1.0×: channel split, concatenation and the channel shuffle's Reshape / Transpose / Reshape."""

    def __init__(self) -> None:
        widths = (24, 116, 232, 464)
        units: list[nn.Module] = [conv_norm_act(3, 24, stride=2), nn.MaxPool2d(3, 2, 1)]
        for c_in, c_out, n in zip(widths, widths[1:], (4, 8, 4)):
            units += [_ShuffleUnit(c_in, c_out, 2), *(_ShuffleUnit(c_out, c_out, 1) for _ in range(n - 1))]
        super().__init__(nn.Sequential(*units, conv_norm_act(464, 1024, 1)), 1024)


class _DenseLayer(nn.Module):
    """DenseNet's layer: BN-ReLU-1×1 to 4·growth, BN-ReLU-3×3 to growth, concatenated to everything before it."""

    def __init__(self, c_in: int, growth: int) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.BatchNorm2d(c_in), nn.ReLU(), nn.Conv2d(c_in, 4 * growth, 1, bias=False),
                               nn.BatchNorm2d(4 * growth), nn.ReLU(), nn.Conv2d(4 * growth, growth, 3, padding=1,
                                                                                bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.f(x)], 1)


class DenseNetLike(_PooledClassifier):
    """DenseNet's layout: dense blocks (every layer reads all the earlier ones' channels), transitions halving the
    channels with a 1×1 conv and average pooling, pre-activation BatchNorms."""

    def __init__(self, growth: int = 16, blocks: tuple[int, ...] = (4, 6, 8)) -> None:
        c = 32
        layers: list[nn.Module] = [conv_norm_act(3, c, 7, stride=2), nn.MaxPool2d(3, 2, 1)]
        for i, n in enumerate(blocks):
            for _ in range(n):
                layers.append(_DenseLayer(c, growth))
                c += growth
            if i < len(blocks) - 1:
                layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2)]
                c //= 2
        super().__init__(nn.Sequential(*layers, nn.BatchNorm2d(c), nn.ReLU()), c)


class _XBlock(nn.Module):
    """RegNetY's block: 1×1, a grouped 3×3 (groups of 8 channels), squeeze-excitation, 1×1, the residual."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.a = conv_norm_act(c_in, c_out, 1)
        self.b = conv_norm_act(c_out, c_out, stride=stride, groups=c_out // 8)
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c_out, c_out // 4, 1), nn.ReLU(),
                                nn.Conv2d(c_out // 4, c_out, 1), nn.Sigmoid())
        self.c = conv_norm_act(c_out, c_out, 1, act=None)
        self.proj = conv_norm_act(c_in, c_out, 1, stride=stride, act=None) if stride > 1 or c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(x))
        return F.relu(self.c(y * self.se(y)) + (x if self.proj is None else self.proj(x)))


class RegNetLike(_PooledClassifier):
    """RegNetY-400MF's layout: stages of ``_XBlock`` with grouped convolutions and squeeze-excitation."""

    def __init__(self, widths: tuple[int, ...] = (48, 104, 208, 440), depths: tuple[int, ...] = (1, 3, 6, 2)) -> None:
        layers: list[nn.Module] = [conv_norm_act(3, 32, stride=2)]
        c = 32
        for w, d in zip(widths, depths):
            layers += [_XBlock(c if i == 0 else w, w, 2 if i == 0 else 1) for i in range(d)]
            c = w
        super().__init__(nn.Sequential(*layers), c)


class _Inception(nn.Module):
    """GoogLeNet's block: 1×1, 1×1→3×3, 1×1→3×3→3×3 and pool→1×1 branches concatenated."""

    def __init__(self, c_in: int, c1: int, c3: tuple[int, int], c5: tuple[int, int], pool: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList([
            conv_norm_act(c_in, c1, 1),
            nn.Sequential(conv_norm_act(c_in, c3[0], 1), conv_norm_act(c3[0], c3[1])),
            nn.Sequential(conv_norm_act(c_in, c5[0], 1), conv_norm_act(c5[0], c5[1]), conv_norm_act(c5[1], c5[1])),
            nn.Sequential(nn.MaxPool2d(3, 1, 1), conv_norm_act(c_in, pool, 1))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], 1)


class InceptionLike(_PooledClassifier):
    """GoogLeNet's stem and three inception blocks (multi-branch Concats read by the next block's 1×1s)."""

    def __init__(self) -> None:
        super().__init__(nn.Sequential(
            conv_norm_act(3, 64, 7, stride=2), nn.MaxPool2d(3, 2, 1), conv_norm_act(64, 192), nn.MaxPool2d(3, 2, 1),
            _Inception(192, 64, (96, 128), (16, 32), 32), _Inception(256, 128, (128, 192), (32, 96), 64),
            nn.MaxPool2d(3, 2, 1), _Inception(480, 192, (96, 208), (16, 48), 64)), 512)


class _GhostModule(nn.Module):
    """timm's GhostModule: a 1×1 conv to half the outputs, a depthwise 3×3 of those ("cheap operation"), both
    concatenated and sliced to the output count (``out[:, :out_chs]``)."""

    def __init__(self, c_in: int, c_out: int, act: bool = True) -> None:
        super().__init__()
        self.c_out, init = c_out, (c_out + 1) // 2
        self.primary = conv_norm_act(c_in, init, 1, act=nn.ReLU if act else None)
        self.cheap = conv_norm_act(init, init, 3, groups=init, act=nn.ReLU if act else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.primary(x)
        return torch.cat((y, self.cheap(y)), 1)[:, :self.c_out]


class _GhostBottleneck(nn.Module):
    """timm's GhostBottleneck: ghost module to ``mid``, a strided depthwise conv where it strides, squeeze-excite
    where asked, a ghost module to the output without activation, plus the shortcut (identity, or a depthwise and a
    1×1 conv)."""

    def __init__(self, c_in: int, mid: int, c_out: int, kernel: int, stride: int, se: bool) -> None:
        super().__init__()
        self.ghost1 = _GhostModule(c_in, mid)
        self.dw = conv_norm_act(mid, mid, kernel, stride, groups=mid, act=None) if stride > 1 else nn.Identity()
        self.se = SqueezeExcitation(mid, make_divisible(mid // 4, 4)) if se else nn.Identity()
        self.ghost2 = _GhostModule(mid, c_out, act=False)
        self.shortcut = nn.Identity() if c_in == c_out and stride == 1 else nn.Sequential(
            conv_norm_act(c_in, c_in, kernel, stride, groups=c_in, act=None), conv_norm_act(c_in, c_out, 1, act=None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ghost2(self.se(self.dw(self.ghost1(x)))) + self.shortcut(x)


class GhostNetLike(nn.Module):
    """GhostNet 1.0× (timm's ``ghostnet_100`` layout): a 3×3 stem to 16, sixteen ghost bottlenecks, a 1×1 to 960,
    pooling, a 1×1 head to 1280 and a linear classifier."""

    CONFIG = ((3, 16, 16, 0, 1), (3, 48, 24, 0, 2), (3, 72, 24, 0, 1), (5, 72, 40, 1, 2), (5, 120, 40, 1, 1),
              (3, 240, 80, 0, 2), (3, 200, 80, 0, 1), (3, 184, 80, 0, 1), (3, 184, 80, 0, 1), (3, 480, 112, 1, 1),
              (3, 672, 112, 1, 1), (5, 672, 160, 1, 2), (5, 960, 160, 0, 1), (5, 960, 160, 1, 1), (5, 960, 160, 0, 1),
              (5, 960, 160, 1, 1))

    def __init__(self) -> None:
        super().__init__()
        blocks: list[nn.Module] = [conv_norm_act(3, 16, stride=2)]
        c = 16
        for kernel, mid, c_out, se, stride in self.CONFIG:
            blocks.append(_GhostBottleneck(c, mid, c_out, kernel, stride, bool(se)))
            c = c_out
        self.features = nn.Sequential(*blocks, conv_norm_act(c, 960, 1))
        self.head = nn.Sequential(nn.Conv2d(960, 1280, 1), nn.ReLU())
        self.fc = nn.Linear(1280, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.head(self.features(x).mean((2, 3), keepdim=True)).flatten(1))


class _MV2(nn.Module):
    """MobileNetV2's inverted residual as MobileViT writes it: expansion 2, SiLU, the residual where shapes allow."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        hidden = 2 * c_in
        self.f = nn.Sequential(conv_norm_act(c_in, hidden, 1, act=nn.SiLU),
                               conv_norm_act(hidden, hidden, stride=stride, groups=hidden, act=nn.SiLU),
                               conv_norm_act(hidden, c_out, 1, act=None))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x) if self.residual else self.f(x)


class _Attention(nn.Module):
    """timm's multi-head self-attention: one qkv Linear, heads split by reshape, softmax(q·kᵀ/√d)·v, a
    projection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5).softmax(-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, n, c))


class _TransformerBlock(nn.Module):
    """A pre-norm transformer block: LayerNorm, attention, residual; LayerNorm, a SiLU MLP of ratio 2, residual."""

    def __init__(self, dim: int, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _MobileViTBlock(nn.Module):
    """timm's MobileVitBlock: a local 3×3 and 1×1, the map unfolded into 2×2 patches folded into the batch
    ([B·4, N, D]), transformer blocks, folded back, a 1×1 projection and a 3×3 fusion with the block's input."""

    def __init__(self, c: int, dim: int, depth: int, patch: int = 2) -> None:
        super().__init__()
        self.local = nn.Sequential(conv_norm_act(c, c, act=nn.SiLU), nn.Conv2d(c, dim, 1, bias=False))
        self.transformer = nn.Sequential(*(_TransformerBlock(dim) for _ in range(depth)), nn.LayerNorm(dim))
        self.proj = conv_norm_act(dim, c, 1, act=nn.SiLU)
        self.fusion = conv_norm_act(2 * c, c, act=nn.SiLU)
        self.patch = patch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        b, d, h, w = y.shape
        p, nh, nw = self.patch, h // self.patch, w // self.patch
        y = y.reshape(b * d * nh, p, nw, p).transpose(1, 2).reshape(b, d, nh * nw, p * p)
        y = self.transformer(y.transpose(1, 3).reshape(b * p * p, nh * nw, d))
        y = y.reshape(b, p * p, nh * nw, d).transpose(1, 3).reshape(b * d * nh, nw, p, p)
        y = self.proj(y.transpose(1, 2).reshape(b, d, h, w))
        return self.fusion(torch.cat((x, y), 1))


class MobileViTLike(nn.Module):
    """MobileViT-XXS's layout (timm): a stem, inverted residuals, then three stages of a strided inverted residual
    and a MobileViT block (transformer widths 64, 80, 96; depths 2, 4, 3), a 1×1 to 320 and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [conv_norm_act(3, 16, stride=2, act=nn.SiLU), _MV2(16, 16, 1), _MV2(16, 24, 2),
                                   _MV2(24, 24, 1), _MV2(24, 24, 1)]
        for c_in, c, dim, depth in ((24, 48, 64, 2), (48, 64, 80, 4), (64, 80, 96, 3)):
            layers += [_MV2(c_in, c, 2), _MobileViTBlock(c, dim, depth)]
        self.features = nn.Sequential(*layers, conv_norm_act(80, 320, 1, act=nn.SiLU))
        self.fc = nn.Linear(320, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


class _SeparableConv(nn.Sequential):
    """timm's SeparableConvNormAct: a depthwise 3×3 (no norm), a 1×1, BatchNorm, ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(c_in, c_in, 3, stride, 1, groups=c_in, bias=False), *conv_norm_act(c_in, c_out, 1))


class _EffectiveSE(nn.Module):
    """VoVNetV2's effective squeeze-excitation: one 1×1 conv from the pooled channels to a hard-sigmoid gate of
    the same channels."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc, self.gate = nn.Conv2d(c, c, 1), nn.Hardsigmoid()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc(x.mean((2, 3), keepdim=True)))


class _OsaBlock(nn.Module):
    """timm's OsaBlock (depthwise): a 1×1 reduction, three separable convs in a chain, the block's input and every
    conv's output concatenated (one-shot aggregation), a 1×1 to the output, the effective SE gate."""

    def __init__(self, c_in: int, mid: int, c_out: int, layers: int = 3) -> None:
        super().__init__()
        self.reduction = conv_norm_act(c_in, mid, 1) if c_in != mid else nn.Identity()
        self.mid = nn.ModuleList(_SeparableConv(mid, mid) for _ in range(layers))
        self.concat = conv_norm_act(c_in + layers * mid, c_out, 1)
        self.attn = _EffectiveSE(c_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs, y = [x], self.reduction(x)
        for conv in self.mid:
            y = conv(y)
            outputs.append(y)
        return self.attn(self.concat(torch.cat(outputs, 1)))


class VoVNetLike(_PooledClassifier):
    """timm's ``ese_vovnet19b_dw``: a stem (3×3 to 64, two separable convs, stride 4), four one-block OSA stages
    (max pooling before the last three), pooling and a linear classifier."""

    def __init__(self) -> None:
        layers: list[nn.Module] = [conv_norm_act(3, 64, stride=2), _SeparableConv(64, 64), _SeparableConv(64, 64, 2)]
        c = 64
        for i, (mid, c_out) in enumerate(zip((128, 160, 192, 224), (256, 512, 768, 1024))):
            layers += [nn.MaxPool2d(3, 2, ceil_mode=True)] if i else []
            layers.append(_OsaBlock(c, mid, c_out))
            c = c_out
        super().__init__(nn.Sequential(*layers), c)


class _RepVGGBlock(nn.Module):
    """RepVGG's training-time block: a 3×3 conv + BatchNorm, a 1×1 conv + BatchNorm and, where the shape allows, a
    BatchNorm of the input, summed, then ReLU (the deploy form is one 3×3 conv)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.dense = conv_norm_act(c_in, c_out, 3, stride, act=None)
        self.one = conv_norm_act(c_in, c_out, 1, stride, act=None)
        self.identity = nn.BatchNorm2d(c_in) if c_in == c_out and stride == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dense(x) + self.one(x)
        return torch.relu(y if self.identity is None else y + self.identity(x))


class RepVGGLike(_PooledClassifier):
    """RepVGG-A0 as trained (widths 48, 48, 96, 192, 1280; 1, 2, 4, 14, 1 blocks, each stage's first at stride 2)."""

    def __init__(self) -> None:
        blocks, c = [], 3
        for width, n in ((48, 1), (48, 2), (96, 4), (192, 14), (1280, 1)):
            for i in range(n):
                blocks.append(_RepVGGBlock(c, width, 2 if i == 0 else 1))
                c = width
        super().__init__(nn.Sequential(*blocks), c)
