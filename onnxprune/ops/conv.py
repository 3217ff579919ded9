"""Conv and ConvTranspose: channel rules, MACs, their weights as matrices, torch kernels."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.ir.graph import const_shape, static_shape
from onnxprune.errors import UnsupportedOpError
from onnxprune.ops.registry import (
    Linear, Mixing, OpEntry, Shape, TorchLayer, bias_of, product, register, set_bias, thin,
)
from onnxprune.ops.roles import AttrSite, Blocked, Channelwise, Consumer, Port, Producer, Regroup, Role, SliceSite, Span
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, given

# ---- channel rules


def _conv_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    weight = const_shape(node.inputs[1])
    if weight is None:
        return Blocked(f"Conv {node.name}: weight is not constant")
    group = int(node.attrs.get("group", 1))
    c_in = weight[1] * group
    bias = [SliceSite(node.name, 2, 0, repeat)] if len(node.inputs) > 2 else []
    if group > 1 and weight[1] == 1 and weight[0] == group:
        # depthwise, multiplier 1: channel c in -> channel c out
        if port not in (("in", 0), ("out", 0)):
            return Blocked(f"Conv {node.name}: channels reach the weight input")
        return Channelwise({("in", 0): (1, repeat), ("out", 0): (1, repeat)},
                           [SliceSite(node.name, 1, 0, repeat), *bias], [AttrSite(node.name, "group", repeat)])
    if group > 1:
        return _grouped_rule(node, port, axis, repeat, span, weight, group)
    if port == ("out", 0):
        return Producer([SliceSite(node.name, 1, 0, repeat), *bias])
    if port == ("in", 0) and axis == 1 and c_in == weight[1]:
        return Consumer("conv", [SliceSite(node.name, 1, 1, repeat)])
    return Blocked(f"Conv {node.name}: channels reach an unsupported input")


def _grouped_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span, weight: Sequence[int],
                  group: int) -> Role:
    """A grouped conv (not depthwise) passes whole conv groups: group k's input channels make only group k's
    outputs, so a space whose unit is a conv group (``Regroup``) maps unit k in to unit k out; dropping it drops
    the group's filters and lowers ``group`` by one. Channels within a group stay."""
    out_unit = weight[0] // group
    unit = {("in", 0): weight[1], ("out", 0): out_unit}.get(port)
    if unit is None or axis != 1:
        return Blocked(f"Conv {node.name}: channels reach the weight input")
    if weight[0] % group:
        return Blocked(f"Conv {node.name}: {weight[0]} filters do not split into {group} groups")
    if span != (0, group * unit // repeat) or (unit % repeat if repeat < unit else repeat % unit):
        return Blocked(f"Conv {node.name}: grouped convolution ({group} groups) reached by a space that is not "
                       "whole conv groups (a range of a Concat or Split, or another unit)")
    if repeat < unit:
        return Regroup(unit // repeat, f"Conv {node.name}: {group} groups of {unit} channels")
    per = repeat // unit  # conv groups a channel of the space spans (several where a head is q, k and v's groups)
    bias = [SliceSite(node.name, 2, 0, out_unit * per)] if len(node.inputs) > 2 else []
    return Channelwise({("in", 0): (1, repeat), ("out", 0): (1, out_unit * per)},
                       [SliceSite(node.name, 1, 0, out_unit * per), *bias], [AttrSite(node.name, "group", per)])


def _conv_transpose_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    weight = const_shape(node.inputs[1])
    if weight is None or int(node.attrs.get("group", 1)) != 1:
        return Blocked(f"ConvTranspose {node.name}: grouped or non-constant weight")
    if port == ("out", 0):
        bias = [SliceSite(node.name, 2, 0, repeat)] if len(node.inputs) > 2 else []
        return Producer([SliceSite(node.name, 1, 1, repeat), *bias])
    auto = node.attrs.get("auto_pad", "NOTSET")
    if auto not in ("NOTSET", b"NOTSET", "") or "output_shape" in node.attrs or len(weight) != 4:
        return Blocked(f"ConvTranspose {node.name}: auto_pad, output_shape or not 2-D: not supported as a consumer")
    if port == ("in", 0) and axis == 1 and repeat == 1:
        return Consumer("conv_transpose", [SliceSite(node.name, 1, 0)])
    return Blocked(f"ConvTranspose {node.name}: channels reach an unsupported input")


# ---- MACs


def _weight_shape(node: gs.Node) -> Sequence[int | None]:
    weight = const_shape(node.inputs[1])
    return weight if weight is not None else static_shape(node.inputs[1])


def _conv_macs(node: gs.Node, inp: Shape, out: Shape) -> int:
    return product(out[1:], node) * product(list(_weight_shape(node)[1:]), node)


def _conv_transpose_macs(node: gs.Node, inp: Shape, out: Shape) -> int:
    return product(inp[1:], node) * product(list(_weight_shape(node)[1:]), node)


# ---- the weights as matrices (see analysis.consumers)


def conv_pads(node: gs.Node) -> list[int]:
    """ONNX pads [b1, b2, e1, e2] of a 2-D Conv, resolving auto_pad from the shapes."""
    kernel = list(node.inputs[1].shape[2:])
    auto = node.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto, bytes):
        auto = auto.decode()
    if auto in ("NOTSET", ""):
        return list(node.attrs.get("pads", [0] * 2 * len(kernel)))
    if auto == "VALID":
        return [0] * 2 * len(kernel)
    strides = node.attrs.get("strides", [1] * len(kernel))
    dil = node.attrs.get("dilations", [1] * len(kernel))
    in_shape = static_shape(node.inputs[0])[2:]
    begin, end = [], []
    for size, k, s, d in zip(in_shape, kernel, strides, dil):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begin.append(large if auto == "SAME_LOWER" else small)
        end.append(small if auto == "SAME_LOWER" else large)
    return begin + end


def conv_unfold(node: gs.Node, x: torch.Tensor) -> torch.Tensor:
    """im2col patches (B, C·kh·kw, L) of a 2-D Conv's input (a free view for an unpadded 1×1)."""
    w_shape = node.inputs[1].shape
    if len(w_shape) == 3:  # 1-D: a 2-D conv over a height of 1
        (begin, end), k = conv_pads(node), w_shape[2]
        return patches(F.pad(x, (begin, end)).unsqueeze(2), (1, k), (1, node.attrs.get("strides", [1])[0]),
                       (1, node.attrs.get("dilations", [1])[0]))
    if len(w_shape) != 4:
        raise UnsupportedOpError(f"Conv {node.name}: only 1-D and 2-D convolutions can be re-fitted")
    pads = conv_pads(node)
    strides = tuple(node.attrs.get("strides", [1, 1]))
    if tuple(w_shape[2:]) == (1, 1) and not any(pads):
        return x[:, :, :: strides[0], :: strides[1]].flatten(2)
    x = F.pad(x, (pads[1], pads[3], pads[0], pads[2]))
    return patches(x, tuple(w_shape[2:]), strides, tuple(node.attrs.get("dilations", [1, 1])))


def patches(x: torch.Tensor, kernel: tuple[int, int], strides: tuple[int, int], dilations: tuple[int, int]
            ) -> torch.Tensor:
    """``F.unfold(x, kernel, dilation, stride)`` of a padded (B, C, H, W): (B, C·kh·kw, L), the same values, copied
    from a strided view (2-3 times faster than torch's im2col on a CPU)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    view = x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]
    b, c, oh, ow = view.shape[:4]
    return view.permute(0, 1, 4, 5, 2, 3).reshape(b, c * kh * kw, oh * ow)


def conv_positions(node: gs.Node, shape: tuple[int, ...]) -> int:
    """Output positions per sample of a Conv on an input of ``shape`` (what ``conv_unfold`` gives as L)."""
    kernel, pads = node.inputs[1].shape[2:], conv_pads(node)
    strides = node.attrs.get("strides", [1] * len(kernel))
    dil = node.attrs.get("dilations", [1] * len(kernel))
    return math.prod((size + pads[i] + pads[i + len(kernel)] - d * (k - 1) - 1) // s + 1
                     for i, (size, k, s, d) in enumerate(zip(shape[2:], kernel, strides, dil)))


def conv_unfold_every(node: gs.Node, x: torch.Tensor, stride: int, first: int) -> torch.Tensor:
    """``conv_unfold``'s every ``stride``-th flattened position (b·L + l) from ``first``, (1, C·kh·kw, M): each kept
    patch gathered from the padded input, none of the others unfolded."""
    w_shape = node.inputs[1].shape
    if len(w_shape) != 4:
        return thin(conv_unfold(node, x), stride, first)
    pads = conv_pads(node)
    (sh, sw), (dh, dw), (kh, kw) = node.attrs.get("strides", [1, 1]), node.attrs.get("dilations", [1, 1]), w_shape[2:]
    x = F.pad(x, (pads[1], pads[3], pads[0], pads[2]))
    b, c, h, w = x.shape
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    q = torch.arange(first, b * oh * ow, stride)
    sample, at = q // (oh * ow), q % (oh * ow)
    rows = (at // ow * sh)[None, :] + (torch.arange(kh) * dh).repeat_interleave(kw)[:, None]  # (taps, M)
    cols = (at % ow * sw)[None, :] + (torch.arange(kw) * dw).repeat(kh)[:, None]
    flat = x.transpose(0, 1).reshape(c, b * h * w)  # one copy of the padded input; the gather reads whole rows
    return flat.index_select(1, (sample[None, :] * (h * w) + rows * w + cols).reshape(-1)).reshape(c * kh * kw, -1)[None]


def conv_transpose_unfold(node: gs.Node, x: torch.Tensor) -> torch.Tensor:
    """A 2-D ConvTranspose is a stride-1 Conv with the flipped kernel on the input with ``stride - 1``
    zeros between pixels, padded by ``dilation·(k-1) - pads`` (+ output_padding at the end): its patches."""
    kh, kw = node.inputs[1].shape[2:]
    sh, sw = node.attrs.get("strides", [1, 1])
    dh, dw = node.attrs.get("dilations", [1, 1])
    top, left, bottom, right = node.attrs.get("pads", [0, 0, 0, 0])
    oph, opw = node.attrs.get("output_padding", [0, 0])
    b, c, h, w = x.shape
    up = x.new_zeros(b, c, (h - 1) * sh + 1, (w - 1) * sw + 1)
    up[:, :, ::sh, ::sw] = x
    up = F.pad(up, (dw * (kw - 1) - left, dw * (kw - 1) - right + opw, dh * (kh - 1) - top, dh * (kh - 1) - bottom + oph))
    return patches(up, (kh, kw), (1, 1), (dh, dw))


def _spatial_columns(node: gs.Node, y: torch.Tensor) -> torch.Tensor:
    return y.flatten(2)


def _conv_matrix(node: gs.Node, w: np.ndarray) -> Linear:
    return Linear(w.reshape(w.shape[0], -1), bias_of(node, w.shape[0]), int(np.prod(w.shape[2:])))


def _conv_transpose_matrix(node: gs.Node, w: np.ndarray) -> Linear:
    """(C, O, kh, kw) -> the equivalent Conv's flipped (O, C, kh, kw)."""
    conv = np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
    return Linear(conv.reshape(conv.shape[0], -1), bias_of(node, w.shape[1]), int(np.prod(w.shape[2:])))


def _conv_write(graph: gs.Graph, node: gs.Node, w: np.ndarray, b: np.ndarray) -> None:
    old = node.inputs[1].shape
    node.inputs[1] = gs.Constant(f"{node.name}.weight", w.reshape(old[0], -1, *old[2:]))
    set_bias(node, b)


def _conv_transpose_write(graph: gs.Graph, node: gs.Node, w: np.ndarray, b: np.ndarray) -> None:
    old = node.inputs[1].shape
    conv = w.reshape(old[1], -1, *old[2:])[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
    node.inputs[1] = gs.Constant(f"{node.name}.weight", np.ascontiguousarray(conv))
    set_bias(node, b)


# ---- torch kernels


def torch_pads(begins: Sequence[int], ends: Sequence[int]) -> list[int]:
    """ONNX per-axis begin/end pads (first spatial axis first) -> F.pad order (last axis first)."""
    out: list[int] = []
    for b, e in zip(reversed(list(begins)), reversed(list(ends))):
        out += [int(b), int(e)]
    return out


def _explicit_pads(node: OpNode, n: int) -> tuple[list[int], list[int]]:
    pads = list(node.get("pads", [0] * (2 * n)))
    return pads[:n], pads[n:]


def _same_pads(auto_pad: str, in_sizes, eff_kernels, strides) -> tuple[list[int], list[int]]:
    begins, ends = [], []
    for size, k, s in zip(in_sizes, eff_kernels, strides):
        out = -(-size // s)
        total = max((out - 1) * s + k - size, 0)
        small, big = total // 2, total - total // 2
        begins.append(small if auto_pad == "SAME_UPPER" else big)
        ends.append(big if auto_pad == "SAME_UPPER" else small)
    return begins, ends


def window_pads(node: OpNode, in_sizes, kernel, strides, dilations) -> tuple[list[int], list[int]]:
    n = len(in_sizes)
    auto_pad = node.get("auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        eff = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
        return _same_pads(auto_pad, in_sizes, eff, strides)
    if auto_pad == "VALID":
        return [0] * n, [0] * n
    return _explicit_pads(node, n)


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _conv(node: OpNode, x: Inputs) -> Tensor:
    t, w, b = x[0], x[1], given(x, 2)
    n = t.dim() - 2
    kernel = list(w.shape[2:])
    strides = list(node.get("strides", [1] * n))
    dilations = list(node.get("dilations", [1] * n))
    begins, ends = window_pads(node, list(t.shape[2:]), kernel, strides, dilations)
    if begins != ends:
        t = F.pad(t, torch_pads(begins, ends))
        begins = [0] * n
    return _CONV[n](t, w, b, strides, begins, dilations, node.get("group", 1))


def _conv_transpose(node: OpNode, x: Inputs) -> Tensor:
    t, w, b = x[0], x[1], given(x, 2)
    n = t.dim() - 2
    group = node.get("group", 1)
    kernel = list(w.shape[2:])
    strides = list(node.get("strides", [1] * n))
    dilations = list(node.get("dilations", [1] * n))
    out_pad = list(node.get("output_padding", [0] * n))
    auto_pad = node.get("auto_pad", "NOTSET")
    in_sizes = list(t.shape[2:])
    full = [(i - 1) * s + (k - 1) * d + 1 for i, s, k, d in zip(in_sizes, strides, kernel, dilations)]
    output_shape = node.get("output_shape")
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if output_shape is not None:
            targets = list(output_shape)[-n:]
        else:
            targets = [i * s for i, s in zip(in_sizes, strides)]
        begins, ends = [], []
        for f, o, p in zip(full, targets, out_pad):
            total = f + p - o
            if auto_pad == "SAME_UPPER":
                begins.append(total // 2)
                ends.append(total - total // 2)
            else:
                begins.append(total - total // 2)
                ends.append(total // 2)
    elif auto_pad == "VALID":
        begins, ends = [0] * n, [0] * n
    else:
        begins, ends = _explicit_pads(node, n)
    y = _CONV_T[n](t, w, None, strides, 0, 0, group, dilations)
    crop = torch_pads([-b_ for b_ in begins], [p - e for p, e in zip(out_pad, ends)])
    if any(crop):
        y = F.pad(y, crop)
    if b is not None:
        y = y + b.reshape(1, -1, *([1] * n))
    return y


register(OpEntry(
    "Conv", channels=_conv_rule, macs=_conv_macs,
    mixing=Mixing(_conv_matrix, conv_unfold, _spatial_columns, _conv_write, unfold_every=conv_unfold_every,
                  positions=conv_positions),
    torch={1: _conv}, check=lambda n, p: None if len(n.get("kernel_shape", [0])) <= 3 else "more than 3 spatial dims",
    layer=TorchLayer(("weight", "bias"), (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)),
))
register(OpEntry(
    "ConvTranspose", channels=_conv_transpose_rule, macs=_conv_transpose_macs,
    mixing=Mixing(_conv_transpose_matrix, conv_transpose_unfold, _spatial_columns, _conv_transpose_write),
    torch={1: _conv_transpose}, layer=TorchLayer(("weight", "bias")),  # its [in, out, ...] weight: not sliced yet
))
