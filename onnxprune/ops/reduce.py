"""Reductions along axes: Reduce*, ArgMax/ArgMin, TopK, CumSum, Softmax, LogSoftmax, Hardmax."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.ir.graph import node_constant, static_shape
from onnxprune.ir.rewrite import only_reader
from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Role, Span, rank_of
from onnxprune.ops.kernel import Inputs, OpFn, OpNode, Tensor, axis_of, given, ints


def reduce_axes(node: gs.Node, rank: int) -> list[int] | None:
    """The axes a Reduce node reduces, each in [0, rank): its ``axes`` attribute, or its constant second input (opset
    18), else None (all axes, or computed ones)."""
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        axes = node_constant(node.inputs[1])
    return None if axes is None else [int(a) % rank for a in np.asarray(axes).reshape(-1)]


@dataclass
class WrittenNorm:
    """A LayerNorm over one axis written out as elementwise ops (``written_layer_norm``)."""

    x: gs.Tensor
    axis: int  # non-negative
    rank: int
    epsilon: float
    out: gs.Tensor  # the Div's output: the normalised x


def written_layer_norm(mean: gs.Node, outputs: set[str]) -> WrittenNorm | None:
    """The norm starting at ``mean``: ``ReduceMean(x)`` over one axis (keepdims) read only by ``d = Sub(x, ·)``; ``d``
    read only by ``Pow(d, 2)`` (or ``Mul(d, d)``) and ``Div(d, ·)``; then ``ReduceMean`` over the same axis, ``Add``
    of a scalar ε, ``Sqrt``, into that ``Div``; none of it one of the graph ``outputs``."""
    shape = static_shape(mean.inputs[0])
    if shape is None:
        return None
    x, axis = mean.inputs[0], _one_axis(mean, len(shape))
    if axis is None or shape[axis] is None:
        return None
    sub = _reader(mean.outputs[0], "Sub", outputs)
    if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean.outputs[0] or sub.outputs[0].name in outputs:
        return None
    d = sub.outputs[0]
    readers = {id(n): n for n in d.outputs}.values()
    square = next((n for n in readers if n.op in ("Pow", "Mul")), None)
    div = next((n for n in readers if n.op == "Div"), None)
    if len(readers) != 2 or square is None or div is None:
        return None
    if square.op == "Pow" and (square.inputs[0] is not d or _scalar(square.inputs[1]) != 2.0):
        return None
    if square.op == "Mul" and not (square.inputs[0] is d and square.inputs[1] is d):
        return None
    var = _reader(square.outputs[0], "ReduceMean", outputs)
    add = None if var is None or _one_axis(var, len(shape)) != axis else _reader(var.outputs[0], "Add", outputs)
    if add is None:
        return None
    epsilon = next((e for e in map(_scalar, add.inputs) if e is not None), None)
    sqrt = _reader(add.outputs[0], "Sqrt", outputs)
    if epsilon is None or sqrt is None or _reader(sqrt.outputs[0], "Div", outputs) is not div or div.inputs[0] is not d:
        return None
    return WrittenNorm(x, axis, len(shape), epsilon, div.outputs[0])


def _one_axis(node: gs.Node, rank: int) -> int | None:
    """The one axis a keepdims Reduce node reduces, else None."""
    axes = reduce_axes(node, rank) if node.attrs.get("keepdims", 1) else None
    return axes[0] if axes is not None and len(axes) == 1 else None


def _reader(tensor: gs.Tensor, op: str, outputs: set[str]) -> gs.Node | None:
    node = only_reader(tensor, outputs)
    return node if node is not None and node.op == op else None


def _scalar(tensor: gs.Tensor) -> float | None:
    value = node_constant(tensor)
    return None if value is None or value.size != 1 else float(value.reshape(-1)[0])


def _reduce_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    rank = rank_of(node.inputs[0])
    axes = None if rank is None else reduce_axes(node, rank)
    if axes is None or port != ("in", 0):
        return Blocked(f"{node.op} {node.name}: reduces over all axes or unknown axes")
    if axis in axes:
        written = node.op == "ReduceMean" and written_layer_norm(node, set()) is not None
        return Blocked(f"{node.op} {node.name}: reduces across channels" + (
            " (a LayerNorm written out: loaded through onnxprune.load, the model has it fused into a "
            "LayerNormalization, which prunes)" if written else ""))
    keep = node.attrs.get("keepdims", 1)
    out_axis = axis if keep else axis - sum(a < axis for a in axes)
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (out_axis, repeat)})


def _softmax_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    rank = rank_of(node.inputs[0])
    if rank is None or int(node.attrs.get("axis", -1)) % rank == axis or repeat != 1:
        return Blocked(f"{node.op} {node.name}: normalises across channels")
    return Channelwise({("in", 0): (axis, 1), ("out", 0): (axis, 1)})


def _reduce_axes(node: OpNode, x: Inputs, rank: int) -> tuple[int, ...] | None:
    """Axes to reduce; None = identity (noop_with_empty_axes with no axes)."""
    axes = node.get("axes")
    if axes is None and given(x, 1) is not None:
        axes = ints(x[1])
    if not axes:
        return None if node.get("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted(axis_of(a, rank) for a in axes))


def _reduce(f: Callable[[Tensor, tuple[int, ...], bool], Tensor]) -> OpFn:
    def fn(node: OpNode, x: Inputs) -> Tensor:
        t = x[0]
        dims = _reduce_axes(node, x, t.dim())
        if dims is None:
            return t
        return f(t, dims, bool(node.get("keepdims", 1)))

    return fn


def _prod(t: Tensor, dims: tuple[int, ...], keep: bool) -> Tensor:
    for d in sorted(dims, reverse=True):
        t = t.prod(d, keepdim=True)
    return t if keep else t.squeeze(dims) if dims else t


_REDUCERS: dict[str, Callable[[Tensor, tuple[int, ...], bool], Tensor]] = {
    "ReduceMean": lambda t, d, k: t.mean(d, keepdim=k),
    "ReduceSum": lambda t, d, k: t.sum(d, keepdim=k),
    "ReduceMax": lambda t, d, k: t.amax(d, keepdim=k),
    "ReduceMin": lambda t, d, k: t.amin(d, keepdim=k),
    "ReduceProd": _prod,
    "ReduceL1": lambda t, d, k: t.abs().sum(d, keepdim=k),
    "ReduceL2": lambda t, d, k: t.square().sum(d, keepdim=k).sqrt(),
    "ReduceSumSquare": lambda t, d, k: t.square().sum(d, keepdim=k),
    "ReduceLogSum": lambda t, d, k: t.sum(d, keepdim=k).log(),
    "ReduceLogSumExp": lambda t, d, k: torch.logsumexp(t, d, keepdim=k),
}


def _arg(largest: bool) -> OpFn:
    def fn(node: OpNode, x: Inputs) -> Tensor:
        t = x[0]
        axis = axis_of(node.get("axis", 0), t.dim())
        keep = bool(node.get("keepdims", 1))
        f = torch.argmax if largest else torch.argmin
        if node.get("select_last_index", 0):
            return t.shape[axis] - 1 - f(t.flip(axis), axis, keepdim=keep)
        return f(t, axis, keepdim=keep)

    return fn


def _top(node: OpNode, t: Tensor, k: int) -> list[Tensor]:
    axis = axis_of(node.get("axis", -1), t.dim())
    largest = bool(node.get("largest", 1))
    # a stable sort: ties come lower index first, as in onnxruntime
    values, indices = torch.sort(t, dim=axis, descending=largest, stable=True)
    return [values.narrow(axis, 0, k), indices.narrow(axis, 0, k)]


def _topk_1(node: OpNode, x: Inputs) -> list[Tensor]:
    """TopK before opset 10: ``k`` is an attribute."""
    return _top(node, x[0], node.get("k"))


def _topk_10(node: OpNode, x: Inputs) -> list[Tensor]:
    """TopK from opset 10: ``k`` is an input."""
    return _top(node, x[0], ints(x[1])[0])


def _cumsum(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axis = axis_of(ints(x[1])[0], t.dim())
    if node.get("reverse", 0):
        t = t.flip(axis)
    y = t.cumsum(axis)
    if node.get("exclusive", 0):
        y = y - t
    return y.flip(axis) if node.get("reverse", 0) else y


def _coerced(f: Callable[[Tensor, int], Tensor]) -> OpFn:
    """A softmax-like op before opset 13: over the input coerced to 2-D at ``axis`` (default 1)."""
    def fn(node: OpNode, x: Inputs) -> Tensor:
        t = x[0]
        axis = axis_of(node.get("axis", 1), t.dim())
        return f(t.reshape(math.prod(t.shape[:axis]), -1), 1).reshape(t.shape)

    return fn


def _along(f: Callable[[Tensor, int], Tensor]) -> OpFn:
    """A softmax-like op from opset 13: along ``axis`` (default -1)."""
    return lambda node, x: f(x[0], axis_of(node.get("axis", -1), x[0].dim()))


def _hardmax(t: Tensor, axis: int) -> Tensor:
    return F.one_hot(t.argmax(axis), t.shape[axis]).movedim(-1, axis).to(t.dtype)


_REDUCE_CHANNELWISE = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceL1", "ReduceProd",
                       "ReduceLogSumExp", "ReduceSumSquare")
for _op, _r in _REDUCERS.items():
    register(OpEntry(_op, channels=_reduce_rule if _op in _REDUCE_CHANNELWISE else None, torch={1: _reduce(_r)},
                     static_inputs=frozenset({1})))
register(OpEntry("ArgMax", torch={1: _arg(True)}))
register(OpEntry("ArgMin", torch={1: _arg(False)}))
register(OpEntry("TopK", torch={1: _topk_1, 10: _topk_10}, static_inputs=frozenset({1})))
register(OpEntry("CumSum", torch={1: _cumsum}, static_inputs=frozenset({1})))
for _op, _f in {"Softmax": lambda t, a: torch.softmax(t, a), "LogSoftmax": lambda t, a: torch.log_softmax(t, a),
                "Hardmax": _hardmax}.items():
    register(OpEntry(_op, channels=_softmax_rule if _op != "Hardmax" else None, torch={1: _coerced(_f), 13: _along(_f)}))
