"""Single-input element-wise ops: activations and unary math (channel-wise when they keep the shape)."""

from __future__ import annotations

import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Role, Span
from onnxprune.ops.kernel import Inputs, OpFn, OpNode, Tensor, opt, unary


def pointwise(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """The rule of an op mapping each entry of its one data input to the same entry of its output."""
    if port != ("in", 0) and port != ("out", 0):
        return Blocked(f"{node.op} {node.name}: channels reach a parameter input")
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})


def _leaky_relu(node: OpNode, x: Inputs) -> Tensor:
    return F.leaky_relu(x[0], node.get("alpha", 0.01))


def _elu(node: OpNode, x: Inputs) -> Tensor:
    return F.elu(x[0], node.get("alpha", 1.0))


def _celu(node: OpNode, x: Inputs) -> Tensor:
    return F.celu(x[0], node.get("alpha", 1.0))


def _selu(node: OpNode, x: Inputs) -> Tensor:
    alpha = node.get("alpha", 1.67326319217681884765625)
    gamma = node.get("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x[0] > 0, x[0], alpha * (torch.exp(x[0]) - 1))


def _thresholded_relu(node: OpNode, x: Inputs) -> Tensor:
    return torch.where(x[0] > node.get("alpha", 1.0), x[0], torch.zeros_like(x[0]))


def _softplus(node: OpNode, x: Inputs) -> Tensor:
    return F.softplus(x[0])


def _gelu(node: OpNode, x: Inputs) -> Tensor:
    return F.gelu(x[0], approximate=node.get("approximate", "none"))


def _hard_sigmoid(node: OpNode, x: Inputs) -> Tensor:
    return (node.get("alpha", 0.2) * x[0] + node.get("beta", 0.5)).clamp(0.0, 1.0)


def _isinf(node: OpNode, x: Inputs) -> Tensor:
    pos, neg = node.get("detect_positive", 1), node.get("detect_negative", 1)
    t = x[0]
    return (torch.isposinf(t) if pos else torch.zeros_like(t, dtype=torch.bool)) | (
        torch.isneginf(t) if neg else torch.zeros_like(t, dtype=torch.bool)
    )


def _clip_6(node: OpNode, x: Inputs) -> Tensor:
    """Clip before opset 11: the bounds are attributes."""
    lo, hi = node.get("min"), node.get("max")
    return x[0].clamp(lo, hi) if lo is not None or hi is not None else x[0]


def _clip_11(node: OpNode, x: Inputs) -> Tensor:
    """Clip from opset 11: the bounds are optional inputs."""
    t = x[0]
    lo, hi = opt(x, 1), opt(x, 2)
    if lo is None and hi is None:
        return t
    if t.is_floating_point():
        # Python-number bounds: hardtanh/clamp then have a cheap backward (a mask), not a `where` graph.
        lo_f = None if lo is None else float(lo)
        hi_f = None if hi is None else float(hi)
        if lo_f is not None and hi_f is not None and lo_f <= hi_f:
            return F.hardtanh(t, lo_f, hi_f)
        return t.clamp(lo_f, hi_f)
    return torch.clamp(t, lo.to(t.dtype) if lo is not None else None, hi.to(t.dtype) if hi is not None else None)


_KERNELS: dict[str, dict[int, OpFn]] = {
    op: {1: unary(f)}
    for op, f in {
        "Neg": torch.neg,
        "Abs": torch.abs,
        "Sqrt": torch.sqrt,
        "Exp": torch.exp,
        "Log": torch.log,
        "Reciprocal": torch.reciprocal,
        "Floor": torch.floor,
        "Ceil": torch.ceil,
        "Round": torch.round,  # half to even, as ONNX
        "Sign": torch.sign,
        "Erf": torch.erf,
        "Sin": torch.sin,
        "Cos": torch.cos,
        "Tan": torch.tan,
        "Asin": torch.asin,
        "Acos": torch.acos,
        "Atan": torch.atan,
        "Sinh": torch.sinh,
        "Cosh": torch.cosh,
        "Asinh": torch.asinh,
        "Acosh": torch.acosh,
        "Atanh": torch.atanh,
        "Not": torch.logical_not,
        "IsNaN": torch.isnan,
        "Relu": torch.relu,
        "Sigmoid": torch.sigmoid,
        "Tanh": torch.tanh,
        "Softsign": F.softsign,
        "Mish": F.mish,
        "HardSwish": F.hardswish,
        "Identity": lambda t: t,
    }.items()
}
_KERNELS.update({
    "LeakyRelu": {1: _leaky_relu},
    "Elu": {1: _elu},
    "Celu": {1: _celu},
    "Selu": {1: _selu},
    "ThresholdedRelu": {1: _thresholded_relu},
    "Softplus": {1: _softplus},
    "Gelu": {1: _gelu},
    "HardSigmoid": {1: _hard_sigmoid},
    "IsInf": {1: _isinf},
    "Clip": {1: _clip_6, 11: _clip_11},
})

_CHANNELWISE = (
    "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu", "Softplus",
    "Softsign", "Identity", "Neg", "Abs", "Erf", "Mish", "Gelu", "Celu", "ThresholdedRelu", "Exp", "Sqrt",
    "Reciprocal", "Floor", "Ceil", "Round", "Sin", "Cos", "Log", "Relu6",
)

for _op in dict.fromkeys([*_CHANNELWISE, *_KERNELS]):
    register(OpEntry(_op, channels=pointwise if _op in _CHANNELWISE else None, torch=_KERNELS.get(_op),
                     static_inputs=frozenset({1, 2}) if _op == "Clip" else frozenset()))
