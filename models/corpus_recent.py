"""More export classes for the third-party corpus (random weights, for structure, time and memory), written after
timm's definitions: ResNeXt's grouped bottlenecks, CSPResNet's cross-stage split, EfficientViT-B0's (MIT) linear
attention with a grouped multi-scale aggregation, EdgeNeXt's channels-last convolution blocks and split
transposed (cross-covariance) attention, and FastViT's re-parameterisable MobileOne and RepMixer blocks as
trained."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models._layers import conv_norm_act
from models.corpus import _PooledClassifier


class _ResNeXtBottleneck(nn.Module):
    """A 1×1, a grouped 3×3 (32 groups), a 1×1 to twice the width, the residual (projected where the shape
    changes)."""

    def __init__(self, c_in: int, width: int, stride: int, groups: int = 32) -> None:
        super().__init__()
        self.f = nn.Sequential(conv_norm_act(c_in, width, 1), conv_norm_act(width, width, stride=stride, groups=groups),
                               conv_norm_act(width, 2 * width, 1, act=None))
        self.proj = (conv_norm_act(c_in, 2 * width, 1, stride=stride, act=None)
                     if stride > 1 or c_in != 2 * width else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.f(x) + (x if self.proj is None else self.proj(x)))


class ResNeXtLike(_PooledClassifier):
    """ResNeXt-26's layout (32×4d, two blocks a stage): a three-conv stem, max pooling, four stages."""

    def __init__(self) -> None:
        layers: list[nn.Module] = [conv_norm_act(3, 32, stride=2), conv_norm_act(32, 32), conv_norm_act(32, 64),
                                   nn.MaxPool2d(3, 2, 1)]
        c = 64
        for i, width in enumerate((128, 256, 512, 1024)):
            layers += [_ResNeXtBottleneck(c, width, 2 if i else 1), _ResNeXtBottleneck(2 * width, width, 1)]
            c = 2 * width
        super().__init__(nn.Sequential(*layers), c)


class _CrossStage(nn.Module):
    """timm's CrossStage: a strided 3×3, a linear 1×1 expansion split in two halves, bottlenecks on the second half
    and a 1×1 transition, the halves concatenated and a 1×1 transition."""

    def __init__(self, c_in: int, c_out: int, stride: int, depth: int) -> None:
        super().__init__()
        self.down = conv_norm_act(c_in, c_in, stride=stride) if stride > 1 else nn.Identity()
        self.expand = conv_norm_act(c_in, 2 * c_out, 1, act=None)
        self.blocks = nn.ModuleList(nn.Sequential(conv_norm_act(c_out, c_out // 2, 1), conv_norm_act(c_out // 2, c_out,
                                                                                                   act=None))
                                    for _ in range(depth))
        self.transition_b = conv_norm_act(c_out, c_out, 1)
        self.transition = conv_norm_act(2 * c_out, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xs, xb = self.expand(self.down(x)).chunk(2, dim=1)
        for block in self.blocks:
            xb = F.leaky_relu(xb + block(xb), 0.1)
        return self.transition(torch.cat([xs, self.transition_b(xb)], 1))


class CSPResNetLike(_PooledClassifier):
    """CSPResNet-50's layout at half its widths: a 7×7 stem, max pooling, four cross stages (3, 3, 5, 2 blocks)."""

    def __init__(self) -> None:
        layers: list[nn.Module] = [conv_norm_act(3, 32, 7, stride=2), nn.MaxPool2d(3, 2, 1)]
        c = 32
        for i, (c_out, depth) in enumerate(zip((64, 128, 256, 512), (3, 3, 5, 2))):
            layers.append(_CrossStage(c, c_out, 2 if i else 1, depth))
            c = c_out
        super().__init__(nn.Sequential(*layers), c)


class _MBConv(nn.Module):
    """EfficientViT's MBConv: a 1×1 expansion and a depthwise 3×3 (bias, Hardswish, no norm), a 1×1 projection
    with BatchNorm; the residual where the shape allows."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, expand: int = 4) -> None:
        super().__init__()
        hidden = expand * c_in
        self.f = nn.Sequential(nn.Conv2d(c_in, hidden, 1), nn.Hardswish(),
                               nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden), nn.Hardswish(),
                               conv_norm_act(hidden, c_out, 1, act=None))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.f(x) if self.residual else self.f(x)


class _LiteMLA(nn.Module):
    """timm's LiteMLA: a 1×1 to q, k, v of every head, a multi-scale copy of it (depthwise 5×5, then a 1×1
    grouped by head and q/k/v), ReLU linear attention per head over the pixels, a 1×1 projection with BatchNorm."""

    def __init__(self, c: int, dim: int = 16, eps: float = 1e-5) -> None:
        super().__init__()
        heads, self.dim, self.eps = c // dim, dim, eps
        total = 3 * heads * dim
        self.qkv = nn.Conv2d(c, total, 1, bias=False)
        self.aggreg = nn.Sequential(nn.Conv2d(total, total, 5, padding=2, groups=total, bias=False),
                                    nn.Conv2d(total, total, 1, groups=3 * heads, bias=False))
        self.proj = conv_norm_act(2 * heads * dim, c, 1, act=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, h, w = x.shape
        qkv = self.qkv(x)
        qkv = torch.cat([qkv, self.aggreg(qkv)], 1).reshape(b, -1, 3 * self.dim, h * w).transpose(-1, -2)
        q, k, v = qkv.chunk(3, dim=-1)
        v = F.pad(v, (0, 1), mode="constant", value=1.0)
        out = F.relu(q) @ (F.relu(k).transpose(-1, -2) @ v)
        out = out[..., :-1] / (out[..., -1:] + self.eps)
        return self.proj(out.transpose(-1, -2).reshape(b, -1, h, w))


class _EfficientViTBlock(nn.Module):
    """LiteMLA with a residual, then an MBConv with a residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.context, self.local = _LiteMLA(c), _MBConv(c, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(x + self.context(x))


class EfficientViTLike(nn.Module):
    """EfficientViT-B0's layout (timm ``efficientvit_b0``: widths 8, 16, 32, 64, 128; a stem with a depthwise
    separable residual, two MBConv stages, two stages of a strided MBConv and LiteMLA blocks), a 1×1 to 1024 and a
    Linear 1024→1280 with LayerNorm and Hardswish before the classifier."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [conv_norm_act(3, 8, stride=2, act=nn.Hardswish)]
        c = 8
        for i, (width, depth) in enumerate(zip((16, 32, 64, 128), (2, 2, 2, 2))):
            layers.append(_MBConv(c, width, 2))
            layers += [_EfficientViTBlock(width) if i >= 2 else _MBConv(width, width) for _ in range(depth - (i < 2))]
            c = width
        self.features = nn.Sequential(*layers, conv_norm_act(c, 1024, 1, act=nn.Hardswish))
        self.head = nn.Sequential(nn.Linear(1024, 1280, bias=False), nn.LayerNorm(1280), nn.Hardswish(),
                                  nn.Linear(1280, 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class _ChannelsLastMLP(nn.Module):
    """LayerNorm over the channels of an NHWC tensor, a Linear MLP of ratio 4 with GELU, a layer scale."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))
        self.gamma = nn.Parameter(torch.full((c,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gamma * self.mlp(self.norm(x))


class _EdgeConvBlock(nn.Module):
    """EdgeNeXt's ConvBlock: a depthwise conv, then the channels-last MLP, the residual."""

    def __init__(self, c: int, kernel: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, kernel, padding=kernel // 2, groups=c)
        self.mlp = _ChannelsLastMLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.dw(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class _SplitTransposeBlock(nn.Module):
    """EdgeNeXt's SDTA: the channels chunked in ``scales`` parts, each part but the last a depthwise 3×3 of itself
    plus the previous part's output (Res2Net's way), cross-covariance attention over the channels of each head
    (a channels × channels attention map), the channels-last MLP, the residual."""

    def __init__(self, c: int, scales: int, heads: int = 4) -> None:
        super().__init__()
        width = -(-c // scales)  # timm's: chunk() makes the last part the short one
        self.convs = nn.ModuleList(nn.Conv2d(width, width, 3, padding=1, groups=width) for _ in range(scales - 1))
        self.norm_xca = nn.LayerNorm(c, eps=1e-6)
        self.heads, self.temperature = heads, nn.Parameter(torch.ones(heads, 1, 1))
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.gamma_xca = nn.Parameter(torch.full((c,), 0.5))
        self.mlp = _ChannelsLastMLP(c)

    def _xca(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 4, 1).unbind(0)
        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1) * self.temperature).softmax(-1)
        return self.proj((attn @ v).permute(0, 3, 1, 2).reshape(b, n, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts, out = x.chunk(len(self.convs) + 1, dim=1), []
        y = parts[0]
        for i, conv in enumerate(self.convs):
            y = conv(y if i == 0 else y + parts[i])
            out.append(y)
        y = torch.cat([*out, parts[-1]], 1)
        b, c, h, w = y.shape
        y = y.reshape(b, c, h * w).permute(0, 2, 1)
        y = y + self.gamma_xca * self._xca(self.norm_xca(y))
        return x + self.mlp(y.reshape(b, h, w, c)).permute(0, 3, 1, 2)


class _ChannelNorm(nn.LayerNorm):
    """A LayerNorm over the channels of an NCHW map, written out (timm's LayerNorm2d in ``channels_first`` form)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight[:, None, None] + self.bias[:, None, None]


class EdgeNeXtLike(nn.Module):
    """EdgeNeXt-XX-Small's layout (widths 24, 48, 88, 168; depths 2, 2, 6, 2; kernels 3, 5, 7, 9): a 4×4 patch stem
    with a channels-first LayerNorm, stages joined by that norm and a 2×2 strided conv, the last block of stages 2-4
    an SDTA (2, 3, 4 scales), a pooled LayerNorm head."""

    def __init__(self) -> None:
        super().__init__()
        dims, depths, kernels, scales = (24, 48, 88, 168), (2, 2, 6, 2), (3, 5, 7, 9), (0, 2, 3, 4)
        layers: list[nn.Module] = [nn.Conv2d(3, dims[0], 4, stride=4), _ChannelNorm(dims[0], eps=1e-6)]
        for i, (d, n, k, s) in enumerate(zip(dims, depths, kernels, scales)):
            if i:
                layers += [_ChannelNorm(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], d, 2, stride=2)]
            layers += [_EdgeConvBlock(d, k) for _ in range(n - (s > 0))]
            layers += [_SplitTransposeBlock(d, s)] if s else []
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.LayerNorm(dims[-1], eps=1e-6), nn.Linear(dims[-1], 1000))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


class _MobileOne(nn.Module):
    """timm's MobileOneBlock as trained: a k×k conv + BatchNorm, a 1×1 conv + BatchNorm (``scale``, where k > 1), a
    BatchNorm of the input (``identity``, where the shape allows), summed; then a squeeze-excitation and GELU where
    asked. ``convs`` 0 leaves the identity alone (FastViT's RepMixer norm)."""

    def __init__(self, c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1, act: bool = True,
                 scale: bool = True, convs: int = 1, se: bool = False) -> None:
        super().__init__()
        self.kxk = nn.ModuleList(conv_norm_act(c_in, c_out, k, stride, groups, act=None) for _ in range(convs))
        self.scale = conv_norm_act(c_in, c_out, 1, stride, groups, act=None) if scale and k > 1 else None
        self.identity = nn.BatchNorm2d(c_in) if c_in == c_out and stride == 1 else None
        self.se = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c_out, c_out // 16, 1), nn.ReLU(),
                                nn.Conv2d(c_out // 16, c_out, 1), nn.Sigmoid()) if se else None
        self.act = nn.GELU() if act else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branches = [*(conv(x) for conv in self.kxk), *(m(x) for m in (self.scale, self.identity) if m is not None)]
        y = sum(branches[1:], branches[0])
        return self.act(y if self.se is None else y * self.se(y))


class _RepMixerBlock(nn.Module):
    """FastViT's RepMixer block as trained: ``x + γ·(mixer(x) − norm(x))`` over depthwise MobileOne blocks, then a
    ConvMlp (a depthwise 7×7 + BatchNorm, a 1×1 to three times the width, GELU, a 1×1 back) with a layer scale."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.mixer = _MobileOne(c, c, 3, groups=c, act=False)
        self.norm = _MobileOne(c, c, 3, groups=c, act=False, scale=False, convs=0)
        self.mlp = nn.Sequential(conv_norm_act(c, c, 7, groups=c, act=None), nn.Conv2d(c, 3 * c, 1), nn.GELU(),
                                 nn.Conv2d(3 * c, c, 1))
        self.gamma1 = nn.Parameter(torch.full((c, 1, 1), 0.5))
        self.gamma2 = nn.Parameter(torch.full((c, 1, 1), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.gamma1 * (self.mixer(x) - self.norm(x))
        return x + self.gamma2 * self.mlp(x)


class _PatchEmbed(nn.Module):
    """FastViT's PatchEmbed: a re-parameterisable large-kernel conv (7×7 and 3×3 + BatchNorm, summed, GELU), grouped
    by input channel (each input channel feeds ``c_out / c_in`` outputs), then a 1×1 MobileOne block."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.large = conv_norm_act(c_in, c_out, 7, 2, groups=c_in, act=None)
        self.small = conv_norm_act(c_in, c_out, 3, 2, groups=c_in, act=None)
        self.pointwise = _MobileOne(c_out, c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(F.gelu(self.large(x) + self.small(x)))


class FastViTLike(nn.Module):
    """FastViT-T8's layout as trained (timm ``fastvit_t8``: widths 48, 96, 192, 384; 2, 2, 4, 2 RepMixer blocks):
    a stem of three MobileOne blocks (the second depthwise), patch embeddings between stages, a depthwise 3×3
    MobileOne block with squeeze-excitation to 768, pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        dims, depths = (48, 96, 192, 384), (2, 2, 4, 2)
        layers: list[nn.Module] = [_MobileOne(3, 48, 3, 2), _MobileOne(48, 48, 3, 2, groups=48), _MobileOne(48, 48, 1)]
        for i, (d, n) in enumerate(zip(dims, depths)):
            layers += [_PatchEmbed(dims[i - 1], d)] if i else []
            layers += [_RepMixerBlock(d) for _ in range(n)]
        layers.append(_MobileOne(384, 768, 3, groups=384, se=True))
        self.features, self.fc = nn.Sequential(*layers), nn.Linear(768, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))
