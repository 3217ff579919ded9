"""Broadcasting n-ary element-wise ops: arithmetic, comparisons, logic, PRelu, Where."""

from __future__ import annotations

from collections.abc import Callable

import onnx_graphsurgeon as gs
import torch

from onnxprune.ir.graph import const_value
from onnxprune.ops.registry import OpEntry, TorchLayer, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Role, SliceSite, Span, channels_at, rank_of
from onnxprune.ops.kernel import Inputs, OpFn, OpNode, Tensor, binary, is_float


def _per_channel_const(node: gs.Node, index: int, data_rank: int, axis: int, entries: int | None,
                       repeat: int) -> SliceSite | None | Blocked:
    """Slice site for a broadcast constant operand, None when it does not vary by channel (``entries``: the
    data's size on the channel axis, ``repeat`` entries a channel)."""
    value = const_value(node.inputs[index])
    if value is None:
        return Blocked(f"{node.name}: input {node.inputs[index].name} is not constant")
    if value.ndim == 0 or value.size == 1:
        return None
    c_axis = axis - (data_rank - value.ndim)
    if c_axis < 0 or value.shape[c_axis] == 1:
        return None
    if entries is not None and value.shape[c_axis] != entries:
        return Blocked(f"{node.name}: constant {node.inputs[index].name} has shape {value.shape}, "
                       "not broadcastable per channel")
    return SliceSite(node.name, index, c_axis, repeat)


def _broadcast(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """Elementwise n-ary op: tensors carrying the channel axis join the space, constants are sliced."""
    out = node.outputs[0]
    out_rank = rank_of(out)
    here = node.inputs[port[1]] if port[0] == "in" else out
    here_rank = rank_of(here)
    if out_rank is None or here_rank is None:
        return Blocked(f"{node.op} {node.name}: unknown tensor rank")
    out_axis = axis + (out_rank - here_rank)
    channels = channels_at(out, out_axis)
    if node.op == "Where" and port == ("in", 0):
        return Blocked(f"Where {node.name}: channels reach the condition input")
    ports: dict[Port, tuple[int, int]] = {("out", 0): (out_axis, repeat)}
    slices: list[SliceSite] = []
    for i, tensor in enumerate(node.inputs):
        rank = rank_of(tensor)
        if rank is None:
            return Blocked(f"{node.op} {node.name}: unknown rank of {tensor.name}")
        in_axis = out_axis - (out_rank - rank)
        if isinstance(tensor, gs.Constant):
            site = _per_channel_const(node, i, out_rank, out_axis, channels, repeat)
            if isinstance(site, Blocked):
                return site
            if site is not None:
                slices.append(site)
            continue
        dim = channels_at(tensor, in_axis) if in_axis >= 0 else 1
        if dim == 1 and channels != 1:
            continue  # broadcast along channels (e.g. a spatial gate): channel-wise
        ports[("in", i)] = (in_axis, repeat)
    return Channelwise(ports, slices)


def _div(node: OpNode, x: Inputs) -> Tensor:
    a, b = x[0], x[1]
    if not is_float(a) and not is_float(b):
        return torch.div(a, b, rounding_mode="trunc")
    return a / b


def _mod(node: OpNode, x: Inputs) -> Tensor:
    return torch.fmod(x[0], x[1]) if node.get("fmod", 0) else torch.remainder(x[0], x[1])


def _pow(node: OpNode, x: Inputs) -> Tensor:
    return torch.pow(x[0], x[1]).to(x[0].dtype)


def _variadic(f: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    def fn(node: OpNode, x: Inputs) -> Tensor:
        out = x[0]
        for t in x[1:]:
            out = f(out, t)
        return out

    return fn


def _mean(node: OpNode, x: Inputs) -> Tensor:
    return _variadic(torch.add)(node, x) / len(x)


def _where(node: OpNode, x: Inputs) -> Tensor:
    return torch.where(x[0].bool(), x[1], x[2])


def _prelu(node: OpNode, x: Inputs) -> Tensor:
    return torch.where(x[0] < 0, x[0] * x[1], x[0])


_KERNELS: dict[str, OpFn] = {
    **{op: binary(f) for op, f in {
        "Add": torch.add,
        "Sub": torch.sub,
        "Mul": torch.mul,
        "Equal": torch.eq,
        "Less": torch.lt,
        "LessOrEqual": torch.le,
        "Greater": torch.gt,
        "GreaterOrEqual": torch.ge,
        "And": torch.logical_and,
        "Or": torch.logical_or,
        "Xor": torch.logical_xor,
    }.items()},
    "Div": _div,
    "Mod": _mod,
    "Pow": _pow,
    "Sum": _variadic(torch.add),
    "Max": _variadic(torch.maximum),
    "Min": _variadic(torch.minimum),
    "Mean": _mean,
    "Where": _where,
    "PRelu": _prelu,
}
_CHANNELWISE = ("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "PRelu", "Where")

_LAYERS = {"PRelu": TorchLayer(("weight",), (torch.nn.PReLU,))}

for _op, _fn in _KERNELS.items():
    register(OpEntry(_op, channels=_broadcast if _op in _CHANNELWISE else None, torch={1: _fn}, layer=_LAYERS.get(_op)))
