"""Pooling: MaxPool, AveragePool, LpPool and their global forms."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.ops.conv import torch_pads, window_pads
from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Role, Span
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, is_float


def _pool(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if axis != 1 or len(node.outputs) > 1 and node.outputs[1].outputs:
        return Blocked(f"{node.op} {node.name}: channels not on axis 1 or pooling indices used")
    return Channelwise({("in", 0): (1, repeat), ("out", 0): (1, repeat)})


def _pool_geometry(node: OpNode, t: Tensor):
    """Kernel, strides, dilations, begin pads and the END extension (may be negative: a crop) that
    make exactly the ONNX number of windows fit with no further padding."""
    n = t.dim() - 2
    kernel = list(node.get("kernel_shape"))
    strides = list(node.get("strides", [1] * n))
    dilations = list(node.get("dilations", [1] * n))
    in_sizes = list(t.shape[2:])
    begins, ends = window_pads(node, in_sizes, kernel, strides, dilations)
    ceil_mode = node.get("ceil_mode", 0)
    auto_pad = node.get("auto_pad", "NOTSET")
    rights, outs = [], []
    for size, k, s, d, b, e in zip(in_sizes, kernel, strides, dilations, begins, ends):
        eff = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            out = -(-size // s)
        elif ceil_mode:
            out = -(-(size + b + e - eff) // s) + 1
            if (out - 1) * s >= size + b:  # the last window would start inside the end padding
                out -= 1
        else:
            out = (size + b + e - eff) // s + 1
        outs.append(out)
        rights.append((out - 1) * s + eff - size - b)
    return kernel, strides, dilations, begins, ends, rights


_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


def _maxpool_check(node: OpNode, proto: onnx.NodeProto) -> str | None:
    if len(proto.output) > 1 and proto.output[1]:
        return "the Indices output is not supported"
    if node.get("storage_order", 0):
        return "storage_order=1 is not supported"
    return None


def _maxpool(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    kernel, strides, dilations, begins, _ends, rights = _pool_geometry(node, t)
    n = t.dim() - 2
    symmetric = begins == rights and all(2 * b <= k for b, k in zip(begins, kernel))
    if symmetric and all(b >= 0 for b in begins):
        return _MAXPOOL[n](t, kernel, strides, begins, dilations)
    fill = float("-inf") if is_float(t) else int(torch.iinfo(t.dtype).min)
    t = F.pad(t, torch_pads(begins, rights), value=fill)
    return _MAXPOOL[n](t, kernel, strides, 0, dilations)


def _window_sum(t: Tensor, kernel, strides, dilations) -> Tensor:
    """Sum over (dilated) windows of an already padded tensor, by strided slices."""
    n = t.dim() - 2
    outs = [(size - ((k - 1) * d + 1)) // s + 1 for size, k, s, d in zip(t.shape[2:], kernel, strides, dilations)]
    total = None
    for offsets in np.ndindex(*kernel):
        sl = [slice(None), slice(None)]
        for o, d, s, out in zip(offsets, dilations, strides, outs):
            start = int(o) * d
            sl.append(slice(start, start + (out - 1) * s + 1, s))
        part = t[tuple(sl)]
        total = part if total is None else total + part
    assert total is not None and n == len(kernel)
    return total


def _avgpool(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    kernel, strides, dilations, begins, ends, rights = _pool_geometry(node, t)
    n = t.dim() - 2
    if all(b == 0 for b in begins) and all(r == 0 for r in rights) and all(d == 1 for d in dilations):
        return _AVGPOOL[n](t, kernel, strides)
    include_pad = node.get("count_include_pad", 0)
    # counts: real input elements (plus the explicit pads when count_include_pad), never the ceil overhang
    in_sizes = list(t.shape[2:])
    mask = torch.ones([1, 1, *in_sizes], dtype=t.dtype, device=t.device)
    if include_pad:
        mask = F.pad(mask, torch_pads(begins, ends), value=1.0)
        mask = F.pad(mask, torch_pads([0] * n, [r - e for r, e in zip(rights, ends)]))
    else:
        mask = F.pad(mask, torch_pads(begins, rights))
    padded = F.pad(t, torch_pads(begins, rights))
    if all(d == 1 for d in dilations):
        size = math.prod(kernel)
        total = _AVGPOOL[n](padded, kernel, strides) * size
        count = _AVGPOOL[n](mask, kernel, strides) * size
    else:
        total = _window_sum(padded, kernel, strides, dilations)
        count = _window_sum(mask, kernel, strides, dilations)
    return total / count


def _global_avgpool(node: OpNode, x: Inputs) -> Tensor:
    return x[0].mean(dim=tuple(range(2, x[0].dim())), keepdim=True)


def _global_maxpool(node: OpNode, x: Inputs) -> Tensor:
    return x[0].amax(dim=tuple(range(2, x[0].dim())), keepdim=True)


def _global_lppool(node: OpNode, x: Inputs) -> Tensor:
    p = node.get("p", 2)
    return x[0].abs().pow(p).sum(dim=tuple(range(2, x[0].dim())), keepdim=True).pow(1.0 / p)


register(OpEntry("MaxPool", channels=_pool, torch={1: _maxpool}, check=_maxpool_check))
register(OpEntry("AveragePool", channels=_pool, torch={1: _avgpool}))
register(OpEntry("GlobalAveragePool", channels=_pool, torch={1: _global_avgpool}))
register(OpEntry("GlobalMaxPool", channels=_pool, torch={1: _global_maxpool}))
register(OpEntry("GlobalLpPool", channels=_pool, torch={1: _global_lppool}))
register(OpEntry("LpPool", channels=_pool))
