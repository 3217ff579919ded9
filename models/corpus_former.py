"""EfficientFormerV2-S0's layout for the third-party corpus (random weights, for structure, time and memory), written
after timm's ``efficientformer_v2.py``: convolutional MLP blocks with a depthwise middle conv and layer scales, then
attention on 2-D maps (1×1 q/k/v convs reshaped into heads, a learnt bias per head and offset, "talking heads": 1×1
convs across the heads before and after the softmax, a depthwise "local value" added to the attention's output), a
strided attention in the third stage and an attention that downsamples into the fourth (its query a depthwise
strided conv plus a pooling), and a classifier of two heads averaged (the distillation head)."""

from __future__ import annotations

import itertools
import math

import torch
from torch import nn

from models._layers import conv_norm_act


class _Gelu(nn.GELU):
    """GELU as ``conv_norm_act`` builds an activation (it passes ``inplace``)."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()


def _bias_index(grid: int, step: int) -> torch.Tensor:
    """timm's relative-position index: |Δrow|·grid + |Δcol| between each query position (every ``step``-th of the
    grid × grid keys, each way) and each key position."""
    keys = list(itertools.product(range(grid), range(grid)))
    queries = list(itertools.product(range(0, grid, step), range(0, grid, step)))
    return torch.tensor([[abs(q[0] - k[0]) * grid + abs(q[1] - k[1]) for k in keys] for q in queries])


class _Attention2d(nn.Module):
    """Attention2d: 8 heads of key width 32, values 4·32 a head; with ``stride`` the map is first reduced by a strided
    depthwise conv and the output upsampled back."""

    def __init__(self, dim: int, resolution: int, stride: int | None = None, heads: int = 8, key: int = 32) -> None:
        super().__init__()
        self.heads, self.scale, self.dh = heads, key ** -0.5, 4 * key * heads
        self.stride_conv = conv_norm_act(dim, dim, 3, stride, groups=dim, act=None) if stride else None
        self.upsample = nn.Upsample(scale_factor=stride, mode="bilinear") if stride else None
        self.res = math.ceil(resolution / stride) if stride else resolution
        self.q, self.k = conv_norm_act(dim, key * heads, 1, act=None), conv_norm_act(dim, key * heads, 1, act=None)
        self.v = conv_norm_act(dim, self.dh, 1, act=None)
        self.v_local = conv_norm_act(self.dh, self.dh, 3, groups=self.dh, act=None)
        self.talking_head1, self.talking_head2 = nn.Conv2d(heads, heads, 1), nn.Conv2d(heads, heads, 1)
        self.proj = conv_norm_act(self.dh, dim, 1, act=None)
        self.biases = nn.Parameter(0.1 * torch.randn(heads, self.res * self.res))
        self.register_buffer("index", _bias_index(self.res, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        if self.stride_conv is not None:
            x = self.stride_conv(x)
        n = self.res * self.res
        q = self.q(x).reshape(b, self.heads, -1, n).permute(0, 1, 3, 2)
        k = self.k(x).reshape(b, self.heads, -1, n)
        v = self.v(x)
        local = self.v_local(v)
        v = v.reshape(b, self.heads, -1, n).permute(0, 1, 3, 2)
        attn = self.talking_head1((q @ k) * self.scale + self.biases[:, self.index])
        attn = self.talking_head2(attn.softmax(dim=-1))
        x = (attn @ v).transpose(2, 3).reshape(b, self.dh, self.res, self.res) + local
        if self.upsample is not None:
            x = self.upsample(x)
        return self.proj(nn.functional.gelu(x))


class _AttentionDown(nn.Module):
    """Attention2dDownsample: 8 heads of key width 16; the query a strided depthwise conv plus a 1×1 pooling of
    stride 2, then a 1×1 conv; keys and values at full resolution, the output at half."""

    def __init__(self, dim: int, out: int, resolution: int, heads: int = 8, key: int = 16) -> None:
        super().__init__()
        self.heads, self.scale, self.dh = heads, key ** -0.5, 4 * key * heads
        self.res, self.res2 = resolution, math.ceil(resolution / 2)
        self.local = nn.Conv2d(dim, dim, 3, 2, 1, groups=dim)
        self.pool = nn.AvgPool2d(1, 2, 0)
        self.q_proj = conv_norm_act(dim, key * heads, 1, act=None)
        self.k = conv_norm_act(dim, key * heads, 1, act=None)
        self.v = conv_norm_act(dim, self.dh, 1, act=None)
        self.v_local = conv_norm_act(self.dh, self.dh, 3, 2, groups=self.dh, act=None)
        self.proj = conv_norm_act(self.dh, out, 1, act=None)
        self.biases = nn.Parameter(0.1 * torch.randn(heads, resolution * resolution))
        self.register_buffer("index", _bias_index(resolution, 2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        q = self.q_proj(self.local(x) + self.pool(x)).reshape(b, self.heads, -1, self.res2 ** 2).permute(0, 1, 3, 2)
        k = self.k(x).reshape(b, self.heads, -1, self.res ** 2)
        v = self.v(x)
        local = self.v_local(v)
        v = v.reshape(b, self.heads, -1, self.res ** 2).permute(0, 1, 3, 2)
        attn = ((q @ k) * self.scale + self.biases[:, self.index]).softmax(dim=-1)
        x = (attn @ v).transpose(2, 3).reshape(b, self.dh, self.res2, self.res2) + local
        return self.proj(nn.functional.gelu(x))


class _Block(nn.Module):
    """x + ls1·attention(x) (where given), then x + ls2·MLP(x): 1×1 up, depthwise 3×3, 1×1 down, BN and GELU."""

    def __init__(self, dim: int, ratio: float, attention: nn.Module | None) -> None:
        super().__init__()
        hidden = int(dim * ratio)
        self.attention = attention
        self.ls1 = nn.Parameter(torch.rand(dim, 1, 1) + 0.5) if attention is not None else None
        self.mlp = nn.Sequential(conv_norm_act(dim, hidden, 1, act=_Gelu),
                                 conv_norm_act(hidden, hidden, 3, groups=hidden, act=_Gelu),
                                 conv_norm_act(hidden, dim, 1, act=None))
        self.ls2 = nn.Parameter(torch.rand(dim, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.attention is not None:
            x = x + self.ls1 * self.attention(x)
        return x + self.ls2 * self.mlp(x)


class EfficientFormerV2Like(nn.Module):
    """EfficientFormerV2-S0 at 224² (timm ``efficientformerv2_s0``: widths 32, 48, 96, 176; depths 2, 2, 6, 4; the
    last two blocks of stages 3 and 4 with attention, stage 3's strided; stage 4 entered by a conv plus an attention
    that downsamples)."""

    def __init__(self) -> None:
        super().__init__()
        dims, depths = (32, 48, 96, 176), (2, 2, 6, 4)
        ratios = ((4, 4), (4, 4), (4, 3, 3, 3, 4, 4), (4, 3, 3, 4))
        self.stem = nn.Sequential(conv_norm_act(3, 16, 3, 2, act=_Gelu), conv_norm_act(16, 32, 3, 2, act=_Gelu))
        stages: list[nn.Module] = []
        resolution = 56
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            if i:
                stages.append(_Downsample(dims[i - 1], dim, resolution, attention=i == 3))
                resolution = math.ceil(resolution / 2)
            for j in range(depth):
                attention = _Attention2d(dim, resolution, 2 if i == 2 else None) if i >= 2 and j >= depth - 2 else None
                stages.append(_Block(dim, ratios[i][j], attention))
        self.stages, self.norm = nn.Sequential(*stages), nn.BatchNorm2d(176)
        self.head, self.head_dist = nn.Linear(176, 1000), nn.Linear(176, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.stages(self.stem(x))).mean((2, 3))
        return (self.head(x) + self.head_dist(x)) / 2


class _Downsample(nn.Module):
    """A strided 3×3 conv and BN, plus (into the last stage) an attention that downsamples."""

    def __init__(self, c_in: int, c_out: int, resolution: int, attention: bool) -> None:
        super().__init__()
        self.conv = conv_norm_act(c_in, c_out, 3, 2, act=None)
        self.attention = _AttentionDown(c_in, c_out, resolution) if attention else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(x)
        return out if self.attention is None else self.attention(x) + out
