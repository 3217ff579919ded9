"""Indexing, dtype, constant and layout ops: Gather*, Cast*, Constant*, Range, Pad, Dropout, DepthToSpace, ..."""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.ir.graph import const_value
from onnxprune.errors import UnsupportedOpError
from onnxprune.ops.conv import torch_pads
from onnxprune.ops.elementwise import pointwise
from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Role, Span, rank_of
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, axis_of, given, ints, onnx_to_torch_dtype


def _pad_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"Pad {node.name}: channels reach a parameter input")
    pads = const_value(node.inputs[1]) if len(node.inputs) > 1 else np.asarray(node.attrs.get("pads", []))
    if pads is None:
        return Blocked(f"Pad {node.name}: pads are not constant")
    rank = len(pads) // 2
    if len(node.inputs) > 3 and node.inputs[3] is not None and const_value(node.inputs[3]) is not None:
        axes = [int(a) % rank for a in const_value(node.inputs[3])]
        rank = rank_of(node.inputs[0]) or rank
    else:
        axes = list(range(rank))
    for j, ax in enumerate(axes):
        if ax == axis and (pads[j] != 0 or pads[j + len(axes)] != 0):
            return Blocked(f"Pad {node.name}: pads the channel axis")
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})


def _gather(node: OpNode, x: Inputs) -> Tensor:
    t, idx = x[0], x[1].long()
    axis = axis_of(node.get("axis", 0), t.dim())
    dim = t.shape[axis]
    idx = torch.where(idx < 0, idx + dim, idx)
    out = t.index_select(axis, idx.reshape(-1))
    return out.reshape((*t.shape[:axis], *idx.shape, *t.shape[axis + 1 :]))


def _gather_elements(node: OpNode, x: Inputs) -> Tensor:
    t, idx = x[0], x[1].long()
    axis = axis_of(node.get("axis", 0), t.dim())
    idx = torch.where(idx < 0, idx + t.shape[axis], idx)
    return torch.gather(t, axis, idx)


def _gather_nd(node: OpNode, x: Inputs) -> Tensor:
    t, idx = x[0], x[1].long()
    b = node.get("batch_dims", 0)
    if b:
        raise UnsupportedOpError(f"GatherND node {node.name!r}: batch_dims={b} is not supported by the evaluator")
    k = idx.shape[-1]
    idx = torch.where(idx < 0, idx + torch.tensor(t.shape[:k], device=idx.device), idx)
    flat = idx.reshape(-1, k)
    out = t[tuple(flat[:, i] for i in range(k))]
    return out.reshape((*idx.shape[:-1], *t.shape[k:]))


def _cast(node: OpNode, x: Inputs) -> Tensor:
    return x[0].to(onnx_to_torch_dtype(node.get("to")))


def _cast_like(node: OpNode, x: Inputs) -> Tensor:
    return x[0].to(x[1].dtype)


def _constant(node: OpNode, x: Inputs) -> Tensor:
    a = node.attrs
    if "value" in a:
        return a["value"]
    if "value_float" in a:
        return torch.tensor(a["value_float"], dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(a["value_floats"], dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(a["value_int"], dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(a["value_ints"], dtype=torch.int64)
    raise UnsupportedOpError(f"Constant node {node.name!r}: only tensor/float/int values are supported")


def _constant_of_shape(node: OpNode, x: Inputs) -> Tensor:
    value = node.get("value")
    shape = ints(x[0])
    if value is None:
        return torch.zeros(shape, dtype=torch.float32, device=x[0].device)
    return torch.full(shape, value.reshape(-1)[0].item(), dtype=value.dtype, device=x[0].device)


def _range(node: OpNode, x: Inputs) -> Tensor:
    start, limit, delta = (t.reshape(()) for t in x[:3])
    n = max(math.ceil((limit.item() - start.item()) / delta.item()), 0)
    steps = torch.arange(n, device=start.device, dtype=start.dtype)
    return start + steps * delta


def _dropout(node: OpNode, x: Inputs) -> list[Tensor]:
    out = [x[0]]
    if node.num_outputs > 1:
        out.append(torch.ones_like(x[0], dtype=torch.bool))
    return out


def _padded(node: OpNode, t: Tensor, pads: list[int], value: float, axes: list[int]) -> Tensor:
    rank = t.dim()
    mode = node.get("mode", "constant")
    n = len(axes)
    begins, ends = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begins[a], ends[a] = pads[i], pads[n + i]
    # F.pad lists from the last dim; drop leading all-zero dims (non-constant modes need few dims)
    first = next((d for d in range(rank) if begins[d] or ends[d]), rank)
    pairs = torch_pads(begins[first:], ends[first:])
    if not pairs:
        return t
    if mode == "constant":
        return F.pad(t, pairs, value=value)
    torch_mode = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode]
    if rank - first > 3:
        raise UnsupportedOpError(f"Pad node {node.name!r}: mode {mode!r} on more than 3 axes is not supported")
    # torch wants (batch, channel-like, *padded): fold the leading dims into one
    folded = t.reshape(math.prod(t.shape[:first]), *t.shape[first:])
    out_shape = [s + b + e for s, b, e in zip(t.shape, begins, ends)]
    return F.pad(folded, pairs, mode=torch_mode).reshape(out_shape)


def _pad_2(node: OpNode, x: Inputs) -> Tensor:
    """Pad before opset 11: pads and value are attributes."""
    return _padded(node, x[0], list(node.get("pads")), float(node.get("value", 0.0)), list(range(x[0].dim())))


def _pad_11(node: OpNode, x: Inputs) -> Tensor:
    """Pad from opset 11: pads, constant value and (18) axes are inputs."""
    t = x[0]
    cv = given(x, 2)
    value = cv.reshape(-1)[0].item() if cv is not None else 0.0
    axes = [axis_of(a, t.dim()) for a in ints(given(x, 3))] or list(range(t.dim()))
    return _padded(node, t, ints(x[1]), value, axes)


def _depth_to_space(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    bs = node.get("blocksize")
    b, c, h, w = t.shape
    if node.get("mode", "DCR") == "DCR":
        y = t.reshape(b, bs, bs, c // bs**2, h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = t.reshape(b, c // bs**2, bs, bs, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(b, c // bs**2, h * bs, w * bs)


def _space_to_depth(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    bs = node.get("blocksize")
    b, c, h, w = t.shape
    y = t.reshape(b, c, h // bs, bs, w // bs, bs).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(b, c * bs * bs, h // bs, w // bs)


def _nonzero(node: OpNode, x: Inputs) -> Tensor:
    return torch.nonzero(x[0]).T.contiguous()


def _one_hot(node: OpNode, x: Inputs) -> Tensor:
    idx, depth, values = x[0].long(), int(ints(x[1])[0]), x[2]
    idx = torch.where(idx < 0, idx + depth, idx)
    axis = node.get("axis", -1)
    hot = F.one_hot(idx.clamp(0, depth - 1), depth) * ((idx >= 0) & (idx < depth)).unsqueeze(-1)
    out = torch.where(hot.bool(), values[1], values[0])
    return out.movedim(-1, axis_of(axis, out.dim()))


_CONSTANT_VALUES = {"value", "value_float", "value_floats", "value_int", "value_ints"}

register(OpEntry("Pad", channels=_pad_rule, torch={1: _pad_2, 11: _pad_11}, static_inputs=frozenset({1, 2, 3})))
register(OpEntry("Dropout", channels=pointwise, torch={1: _dropout}))
register(OpEntry("Cast", channels=pointwise, torch={1: _cast}))
register(OpEntry("CastLike", torch={1: _cast_like}))
register(OpEntry("Gather", torch={1: _gather}, static_inputs=frozenset({1})))
register(OpEntry("GatherElements", torch={1: _gather_elements}, static_inputs=frozenset({1})))
register(OpEntry("GatherND", torch={1: _gather_nd}, static_inputs=frozenset({1})))
register(OpEntry("Constant", torch={1: _constant},
                 check=lambda n, p: None if set(n.attrs) & _CONSTANT_VALUES else "string/sparse values are not supported"))
register(OpEntry("ConstantOfShape", torch={1: _constant_of_shape}, static_inputs=frozenset({0})))
register(OpEntry("Range", torch={1: _range}, static_inputs=frozenset({0, 1, 2})))
register(OpEntry("DepthToSpace", torch={1: _depth_to_space}))
register(OpEntry("SpaceToDepth", torch={1: _space_to_depth}))
register(OpEntry("NonZero", torch={1: _nonzero}))
register(OpEntry("OneHot", torch={1: _one_hot}, static_inputs=frozenset({1, 2})))
