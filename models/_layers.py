"""Building blocks shared by the zoo: torchvision's Conv2dNormActivation layout and channel rounding."""

from __future__ import annotations

from torch import nn


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round ``value`` to a multiple of ``divisor`` without going below 90 % of it (torchvision rule)."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def conv_norm_act(
    in_ch: int,
    out_ch: int,
    kernel: int = 3,
    stride: int = 1,
    groups: int = 1,
    norm: type[nn.Module] | None = nn.BatchNorm2d,
    act: type[nn.Module] | None = nn.ReLU,
    norm_kwargs: dict[str, float] | None = None,
) -> nn.Sequential:
    """Conv (bias only without norm) -> norm -> activation, keyed ``0``, ``1``, ``2`` like torchvision."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_ch, out_ch, kernel, stride, (kernel - 1) // 2, groups=groups, bias=norm is None)
    ]
    if norm is not None:
        layers.append(norm(out_ch, **(norm_kwargs or {})))
    if act is not None:
        layers.append(act(inplace=True))
    return nn.Sequential(*layers)
