"""A small ONNX -> torch evaluator: run an ONNX graph as a differentiable ``torch.nn.Module``.

Used where onnxruntime cannot help: gradients of the network's final discrepancy w.r.t. a
per-channel mask (global imitation) and training the pruned model's weights (few-shot recovery).

* ``OPS`` maps an ONNX ``op_type`` (default domain) to a torch implementation
  ``fn(node: OpNode, inputs: list[Tensor | None]) -> Tensor | Sequence[Tensor]``; register more
  with ``@register_op("OpType", static_inputs=(...), check=...)``.
* ``TorchGraph(model, outputs=..., inputs_at=..., hooks=...)`` evaluates the graph (or only the
  part downstream of ``inputs_at``); float initializers are ``nn.Parameter``s (shape-like floats
  and BatchNormalization statistics are buffers), ``Constant`` nodes are buffers.
* ``write_back(model, torch_graph)`` copies the (trained) tensors back into the initializers.

Semantics follow the ONNX spec as onnxruntime implements it, opsets 7-21 (attributes that later
became inputs are read from either place).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

from onnxprune.errors import ModelError, UnsupportedOpError

Tensor = torch.Tensor
Inputs = list[Tensor | None]
OpFn = Callable[["OpNode", Inputs], "Tensor | Sequence[Tensor]"]

__all__ = ["OPS", "OpNode", "OpSpec", "TorchGraph", "register_op", "write_back", "onnx_to_torch_dtype"]


# --------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpNode:
    """What an op implementation sees of its node: parsed attributes and a little context."""

    name: str
    op_type: str
    attrs: dict[str, Any]
    num_outputs: int
    opset: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


@dataclass(frozen=True)
class OpSpec:
    """A registered op: its function, the input slots that are never trained (shapes, scales, BN
    statistics: float initializers only used there become buffers), and an optional check that
    returns why a particular node cannot be evaluated (reported at construction time)."""

    fn: OpFn
    static_inputs: frozenset[int] = field(default_factory=frozenset)
    check: Callable[[OpNode, onnx.NodeProto], str | None] | None = None


OPS: dict[str, OpSpec] = {}


def register_op(
    *op_types: str,
    static_inputs: Sequence[int] = (),
    check: Callable[[OpNode, onnx.NodeProto], str | None] | None = None,
) -> Callable[[OpFn], OpFn]:
    """Decorator registering ``fn`` for each of ``op_types`` in ``OPS``."""

    def deco(fn: OpFn) -> OpFn:
        for op in op_types:
            if op in OPS:
                raise ValueError(f"{op} already has the torch function {OPS[op].fn.__name__}: one per op type")
            OPS[op] = OpSpec(fn, frozenset(static_inputs), check)
        return fn

    return deco


# --------------------------------------------------------------------------------------------
# dtype helpers
# --------------------------------------------------------------------------------------------

_DTYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT8: torch.int8,
    TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32,
    TensorProto.INT64: torch.int64,
    TensorProto.UINT8: torch.uint8,
    TensorProto.UINT16: torch.uint16,
    TensorProto.UINT32: torch.uint32,
    TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool,
}


def onnx_to_torch_dtype(elem_type: int) -> torch.dtype:
    """The torch dtype of an ONNX ``TensorProto.DataType``."""
    if elem_type not in _DTYPES:
        raise UnsupportedOpError(
            f"ONNX tensor type {TensorProto.DataType.Name(elem_type)} has no torch equivalent in the evaluator"
        )
    return _DTYPES[elem_type]


def _tensor_from_proto(t: onnx.TensorProto, base_dir: str = "") -> Tensor:
    if t.data_type == TensorProto.BFLOAT16:
        arr = numpy_helper.to_array(t, base_dir).astype(np.float32)
        return torch.from_numpy(np.array(arr)).to(torch.bfloat16)
    arr = numpy_helper.to_array(t, base_dir)
    return torch.from_numpy(np.array(arr, copy=True))


def _parse_attr(a: onnx.AttributeProto) -> Any:
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return _tensor_from_proto(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    return v


def _ints(t: Tensor | None) -> list[int]:
    if t is None:
        return []
    return [int(v) for v in t.reshape(-1).tolist()]


def _floats(t: Tensor | None) -> list[float]:
    if t is None:
        return []
    return [float(v) for v in t.reshape(-1).tolist()]


def _given(inputs: Inputs, i: int) -> Tensor | None:
    """Input ``i`` if present and not an empty tensor (ONNX marks absent optionals both ways)."""
    if i < len(inputs) and inputs[i] is not None and inputs[i].numel() > 0:
        return inputs[i]
    return None


def _opt(inputs: Inputs, i: int) -> Tensor | None:
    return inputs[i] if i < len(inputs) else None


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _is_float(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


# --------------------------------------------------------------------------------------------
# element-wise
# --------------------------------------------------------------------------------------------


def _binary(f: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    return lambda node, x: f(x[0], x[1])


def _unary(f: Callable[[Tensor], Tensor]) -> OpFn:
    return lambda node, x: f(x[0])


for _op, _f in {
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
}.items():
    register_op(_op)(_binary(_f))

for _op, _f in {
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
}.items():
    register_op(_op)(_unary(_f))


@register_op("Div")
def _div(node: OpNode, x: Inputs) -> Tensor:
    a, b = x[0], x[1]
    if not _is_float(a) and not _is_float(b):
        return torch.div(a, b, rounding_mode="trunc")
    return a / b


@register_op("Mod")
def _mod(node: OpNode, x: Inputs) -> Tensor:
    return torch.fmod(x[0], x[1]) if node.get("fmod", 0) else torch.remainder(x[0], x[1])


@register_op("Pow")
def _pow(node: OpNode, x: Inputs) -> Tensor:
    return torch.pow(x[0], x[1]).to(x[0].dtype)


@register_op("IsInf")
def _isinf(node: OpNode, x: Inputs) -> Tensor:
    pos, neg = node.get("detect_positive", 1), node.get("detect_negative", 1)
    t = x[0]
    return (torch.isposinf(t) if pos else torch.zeros_like(t, dtype=torch.bool)) | (
        torch.isneginf(t) if neg else torch.zeros_like(t, dtype=torch.bool)
    )


def _variadic(f: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    def fn(node: OpNode, x: Inputs) -> Tensor:
        out = x[0]
        for t in x[1:]:
            out = f(out, t)
        return out

    return fn


register_op("Sum")(_variadic(torch.add))
register_op("Max")(_variadic(torch.maximum))
register_op("Min")(_variadic(torch.minimum))


@register_op("Mean")
def _mean(node: OpNode, x: Inputs) -> Tensor:
    return _variadic(torch.add)(node, x) / len(x)


@register_op("Where")
def _where(node: OpNode, x: Inputs) -> Tensor:
    return torch.where(x[0].bool(), x[1], x[2])


# --------------------------------------------------------------------------------------------
# activations
# --------------------------------------------------------------------------------------------


@register_op("LeakyRelu")
def _leaky_relu(node: OpNode, x: Inputs) -> Tensor:
    return F.leaky_relu(x[0], node.get("alpha", 0.01))


@register_op("PRelu")
def _prelu(node: OpNode, x: Inputs) -> Tensor:
    return torch.where(x[0] < 0, x[0] * x[1], x[0])


@register_op("Elu")
def _elu(node: OpNode, x: Inputs) -> Tensor:
    return F.elu(x[0], node.get("alpha", 1.0))


@register_op("Celu")
def _celu(node: OpNode, x: Inputs) -> Tensor:
    return F.celu(x[0], node.get("alpha", 1.0))


@register_op("Selu")
def _selu(node: OpNode, x: Inputs) -> Tensor:
    alpha = node.get("alpha", 1.67326319217681884765625)
    gamma = node.get("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x[0] > 0, x[0], alpha * (torch.exp(x[0]) - 1))


@register_op("ThresholdedRelu")
def _thresholded_relu(node: OpNode, x: Inputs) -> Tensor:
    return torch.where(x[0] > node.get("alpha", 1.0), x[0], torch.zeros_like(x[0]))


@register_op("Softplus")
def _softplus(node: OpNode, x: Inputs) -> Tensor:
    return F.softplus(x[0])


@register_op("Gelu")
def _gelu(node: OpNode, x: Inputs) -> Tensor:
    return F.gelu(x[0], approximate=node.get("approximate", "none"))


@register_op("HardSigmoid")
def _hard_sigmoid(node: OpNode, x: Inputs) -> Tensor:
    return (node.get("alpha", 0.2) * x[0] + node.get("beta", 0.5)).clamp(0.0, 1.0)


@register_op("Clip", static_inputs=(1, 2))
def _clip(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    if node.opset < 11:
        lo, hi = node.get("min"), node.get("max")
        return t.clamp(lo, hi) if lo is not None or hi is not None else t
    lo, hi = _opt(x, 1), _opt(x, 2)
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


def _softmax_like(f: Callable[[Tensor, int], Tensor]) -> OpFn:
    def fn(node: OpNode, x: Inputs) -> Tensor:
        t = x[0]
        if node.opset < 13:  # coerce to 2-D at ``axis`` (default 1)
            axis = _axis(node.get("axis", 1), t.dim())
            lead = math.prod(t.shape[:axis])
            return f(t.reshape(lead, -1), 1).reshape(t.shape)
        return f(t, _axis(node.get("axis", -1), t.dim()))

    return fn


def _hardmax(t: Tensor, axis: int) -> Tensor:
    return F.one_hot(t.argmax(axis), t.shape[axis]).movedim(-1, axis).to(t.dtype)


register_op("Softmax")(_softmax_like(lambda t, a: torch.softmax(t, a)))
register_op("LogSoftmax")(_softmax_like(lambda t, a: torch.log_softmax(t, a)))
register_op("Hardmax")(_softmax_like(_hardmax))


# --------------------------------------------------------------------------------------------
# convolution / linear
# --------------------------------------------------------------------------------------------


def _torch_pads(begins: Sequence[int], ends: Sequence[int]) -> list[int]:
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


def _window_pads(node: OpNode, in_sizes, kernel, strides, dilations) -> tuple[list[int], list[int]]:
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


@register_op("Conv", check=lambda n, p: None if len(n.get("kernel_shape", [0])) <= 3 else "more than 3 spatial dims")
def _conv(node: OpNode, x: Inputs) -> Tensor:
    t, w, b = x[0], x[1], _given(x, 2)
    n = t.dim() - 2
    kernel = list(w.shape[2:])
    strides = list(node.get("strides", [1] * n))
    dilations = list(node.get("dilations", [1] * n))
    begins, ends = _window_pads(node, list(t.shape[2:]), kernel, strides, dilations)
    if begins != ends:
        t = F.pad(t, _torch_pads(begins, ends))
        begins = [0] * n
    return _CONV[n](t, w, b, strides, begins, dilations, node.get("group", 1))


@register_op("ConvTranspose")
def _conv_transpose(node: OpNode, x: Inputs) -> Tensor:
    t, w, b = x[0], x[1], _given(x, 2)
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
    crop = _torch_pads([-b_ for b_ in begins], [p - e for p, e in zip(out_pad, ends)])
    if any(crop):
        y = F.pad(y, crop)
    if b is not None:
        y = y + b.reshape(1, -1, *([1] * n))
    return y


@register_op("Gemm")
def _gemm(node: OpNode, x: Inputs) -> Tensor:
    a, b, c = x[0], x[1], _given(x, 2)
    if node.get("transA", 0):
        a = a.transpose(0, 1)
    if node.get("transB", 0):
        b = b.transpose(0, 1)
    y = a @ b
    alpha, beta = node.get("alpha", 1.0), node.get("beta", 1.0)
    if alpha != 1.0:
        y = alpha * y
    if c is not None:
        y = y + (c if beta == 1.0 else beta * c)
    return y


@register_op("MatMul")
def _matmul(node: OpNode, x: Inputs) -> Tensor:
    return torch.matmul(x[0], x[1])


@register_op("Einsum")
def _einsum(node: OpNode, x: Inputs) -> Tensor:
    return torch.einsum(node.get("equation"), *x)


# --------------------------------------------------------------------------------------------
# normalisation
# --------------------------------------------------------------------------------------------


@register_op(
    "BatchNormalization",
    static_inputs=(3, 4),
    check=lambda n, p: "training_mode=1 (export the model in eval mode)" if n.get("training_mode", 0) else None,
)
def _batch_norm(node: OpNode, x: Inputs) -> Tensor:
    t, scale, bias, mean, var = x[:5]
    return F.batch_norm(t, mean, var, scale, bias, False, 0.0, node.get("epsilon", 1e-5))


@register_op("InstanceNormalization")
def _instance_norm(node: OpNode, x: Inputs) -> Tensor:
    return F.instance_norm(x[0], weight=x[1], bias=x[2], eps=node.get("epsilon", 1e-5))


@register_op("LayerNormalization")
def _layer_norm(node: OpNode, x: Inputs) -> Tensor:
    t, scale, bias = x[0], x[1], _given(x, 2)
    axis = _axis(node.get("axis", -1), t.dim())
    dims = tuple(range(axis, t.dim()))
    mean = t.mean(dims, keepdim=True)
    var = (t - mean).square().mean(dims, keepdim=True)
    y = (t - mean) * torch.rsqrt(var + node.get("epsilon", 1e-5)) * scale
    return y + bias if bias is not None else y


@register_op("LRN")
def _lrn(node: OpNode, x: Inputs) -> Tensor:
    return F.local_response_norm(
        x[0], node.get("size"), node.get("alpha", 1e-4), node.get("beta", 0.75), node.get("bias", 1.0)
    )


# --------------------------------------------------------------------------------------------
# pooling
# --------------------------------------------------------------------------------------------


def _pool_geometry(node: OpNode, t: Tensor):
    """Kernel, strides, dilations, begin pads and the END extension (may be negative: a crop) that
    make exactly the ONNX number of windows fit with no further padding."""
    n = t.dim() - 2
    kernel = list(node.get("kernel_shape"))
    strides = list(node.get("strides", [1] * n))
    dilations = list(node.get("dilations", [1] * n))
    in_sizes = list(t.shape[2:])
    begins, ends = _window_pads(node, in_sizes, kernel, strides, dilations)
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


@register_op("MaxPool", check=_maxpool_check)
def _maxpool(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    kernel, strides, dilations, begins, _ends, rights = _pool_geometry(node, t)
    n = t.dim() - 2
    symmetric = begins == rights and all(2 * b <= k for b, k in zip(begins, kernel))
    if symmetric and all(b >= 0 for b in begins):
        return _MAXPOOL[n](t, kernel, strides, begins, dilations)
    fill = float("-inf") if _is_float(t) else int(torch.iinfo(t.dtype).min)
    t = F.pad(t, _torch_pads(begins, rights), value=fill)
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


@register_op("AveragePool")
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
        mask = F.pad(mask, _torch_pads(begins, ends), value=1.0)
        mask = F.pad(mask, _torch_pads([0] * n, [r - e for r, e in zip(rights, ends)]))
    else:
        mask = F.pad(mask, _torch_pads(begins, rights))
    padded = F.pad(t, _torch_pads(begins, rights))
    if all(d == 1 for d in dilations):
        size = math.prod(kernel)
        total = _AVGPOOL[n](padded, kernel, strides) * size
        count = _AVGPOOL[n](mask, kernel, strides) * size
    else:
        total = _window_sum(padded, kernel, strides, dilations)
        count = _window_sum(mask, kernel, strides, dilations)
    return total / count


@register_op("GlobalAveragePool")
def _global_avgpool(node: OpNode, x: Inputs) -> Tensor:
    return x[0].mean(dim=tuple(range(2, x[0].dim())), keepdim=True)


@register_op("GlobalMaxPool")
def _global_maxpool(node: OpNode, x: Inputs) -> Tensor:
    return x[0].amax(dim=tuple(range(2, x[0].dim())), keepdim=True)


@register_op("GlobalLpPool")
def _global_lppool(node: OpNode, x: Inputs) -> Tensor:
    p = node.get("p", 2)
    return x[0].abs().pow(p).sum(dim=tuple(range(2, x[0].dim())), keepdim=True).pow(1.0 / p)


# --------------------------------------------------------------------------------------------
# reductions
# --------------------------------------------------------------------------------------------


def _reduce_axes(node: OpNode, x: Inputs, rank: int) -> tuple[int, ...] | None:
    """Axes to reduce; None = identity (noop_with_empty_axes with no axes)."""
    axes = node.get("axes")
    if axes is None and _given(x, 1) is not None:
        axes = _ints(x[1])
    if not axes:
        return None if node.get("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted(_axis(a, rank) for a in axes))


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
for _op, _r in _REDUCERS.items():
    register_op(_op, static_inputs=(1,))(_reduce(_r))


def _arg(largest: bool) -> OpFn:
    def fn(node: OpNode, x: Inputs) -> Tensor:
        t = x[0]
        axis = _axis(node.get("axis", 0), t.dim())
        keep = bool(node.get("keepdims", 1))
        f = torch.argmax if largest else torch.argmin
        if node.get("select_last_index", 0):
            return t.shape[axis] - 1 - f(t.flip(axis), axis, keepdim=keep)
        return f(t, axis, keepdim=keep)

    return fn


register_op("ArgMax")(_arg(True))
register_op("ArgMin")(_arg(False))


@register_op("TopK", static_inputs=(1,))
def _topk(node: OpNode, x: Inputs) -> list[Tensor]:
    t = x[0]
    k = _ints(x[1])[0] if node.opset >= 10 else node.get("k")
    axis = _axis(node.get("axis", -1), t.dim())
    largest = bool(node.get("largest", 1))
    # a stable sort: ties come lower index first, as in onnxruntime
    values, indices = torch.sort(t, dim=axis, descending=largest, stable=True)
    values, indices = values.narrow(axis, 0, k), indices.narrow(axis, 0, k)
    return [values, indices]


@register_op("CumSum", static_inputs=(1,))
def _cumsum(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axis = _axis(_ints(x[1])[0], t.dim())
    if node.get("reverse", 0):
        t = t.flip(axis)
    y = t.cumsum(axis)
    if node.get("exclusive", 0):
        y = y - t
    return y.flip(axis) if node.get("reverse", 0) else y


# --------------------------------------------------------------------------------------------
# shape manipulation
# --------------------------------------------------------------------------------------------


@register_op("Shape")
def _shape(node: OpNode, x: Inputs) -> Tensor:
    dims = list(x[0].shape)
    rank = len(dims)
    start = node.get("start", 0)
    end = node.get("end", rank)
    start = min(max(_axis(start, rank), 0), rank)
    end = min(max(_axis(end, rank), 0), rank)
    return torch.tensor(dims[start:end], dtype=torch.int64, device=x[0].device)


@register_op("Size")
def _size(node: OpNode, x: Inputs) -> Tensor:
    return torch.tensor(x[0].numel(), dtype=torch.int64, device=x[0].device)


@register_op("Flatten")
def _flatten(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axis = _axis(node.get("axis", 1), t.dim())
    return t.reshape(math.prod(t.shape[:axis]), math.prod(t.shape[axis:]))


@register_op("Reshape", static_inputs=(1,))
def _reshape(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    shape = _ints(x[1]) if node.opset >= 5 else list(node.get("shape"))
    if not node.get("allowzero", 0):
        shape = [t.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return t.reshape(shape)


@register_op("Transpose")
def _transpose(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    perm = node.get("perm") or list(reversed(range(t.dim())))
    return t.permute(*perm)


@register_op("Squeeze", static_inputs=(1,))
def _squeeze(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axes = node.get("axes")
    if axes is None:
        axes = _ints(_given(x, 1))
    if not axes:
        return t.squeeze()
    return t.squeeze(tuple(_axis(a, t.dim()) for a in axes))


@register_op("Unsqueeze", static_inputs=(1,))
def _unsqueeze(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axes = node.get("axes")
    if axes is None:
        axes = _ints(x[1])
    rank = t.dim() + len(axes)
    for a in sorted(_axis(a, rank) for a in axes):
        t = t.unsqueeze(a)
    return t


@register_op("Concat")
def _concat(node: OpNode, x: Inputs) -> Tensor:
    tensors = [t for t in x if t is not None]
    return torch.cat(tensors, _axis(node.get("axis"), tensors[0].dim()))


@register_op("Split", static_inputs=(1,))
def _split(node: OpNode, x: Inputs) -> list[Tensor]:
    t = x[0]
    axis = _axis(node.get("axis", 0), t.dim())
    sizes = node.get("split")
    if sizes is None and _given(x, 1) is not None:
        sizes = _ints(x[1])
    dim = t.shape[axis]
    if not sizes:
        parts = node.get("num_outputs", node.num_outputs)
        chunk = -(-dim // parts)
        sizes = [min(chunk, dim - i * chunk) for i in range(parts)]
    return list(torch.split(t, list(sizes), axis))


@register_op("Slice", static_inputs=(1, 2, 3, 4))
def _slice(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    if node.opset < 10:
        starts, ends = list(node.get("starts")), list(node.get("ends"))
        axes = list(node.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        starts, ends = _ints(x[1]), _ints(x[2])
        axes = _ints(_given(x, 3)) or list(range(len(starts)))
        steps = _ints(_given(x, 4)) or [1] * len(starts)
    index: list[Any] = [slice(None)] * t.dim()
    flips: list[tuple[int, int, int, int]] = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _axis(axis, t.dim())
        dim = t.shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
            index[axis] = slice(start, max(start, end), step)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            flips.append((axis, start, end, step))
    t = t[tuple(index)]
    for axis, start, end, step in flips:
        idx = torch.arange(start, end, step, device=t.device)
        t = t.index_select(axis, idx)
    return t


@register_op("Gather", static_inputs=(1,))
def _gather(node: OpNode, x: Inputs) -> Tensor:
    t, idx = x[0], x[1].long()
    axis = _axis(node.get("axis", 0), t.dim())
    dim = t.shape[axis]
    idx = torch.where(idx < 0, idx + dim, idx)
    out = t.index_select(axis, idx.reshape(-1))
    return out.reshape((*t.shape[:axis], *idx.shape, *t.shape[axis + 1 :]))


@register_op("GatherElements", static_inputs=(1,))
def _gather_elements(node: OpNode, x: Inputs) -> Tensor:
    t, idx = x[0], x[1].long()
    axis = _axis(node.get("axis", 0), t.dim())
    idx = torch.where(idx < 0, idx + t.shape[axis], idx)
    return torch.gather(t, axis, idx)


@register_op("GatherND", static_inputs=(1,))
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


@register_op("Cast")
def _cast(node: OpNode, x: Inputs) -> Tensor:
    return x[0].to(onnx_to_torch_dtype(node.get("to")))


@register_op("CastLike")
def _cast_like(node: OpNode, x: Inputs) -> Tensor:
    return x[0].to(x[1].dtype)


def _constant_value(node: OpNode) -> Tensor:
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


@register_op(
    "Constant",
    check=lambda n, p: None
    if set(n.attrs) & {"value", "value_float", "value_floats", "value_int", "value_ints"}
    else "string/sparse values are not supported",
)
def _constant(node: OpNode, x: Inputs) -> Tensor:
    return _constant_value(node)


@register_op("ConstantOfShape", static_inputs=(0,))
def _constant_of_shape(node: OpNode, x: Inputs) -> Tensor:
    value = node.get("value")
    shape = _ints(x[0])
    if value is None:
        return torch.zeros(shape, dtype=torch.float32, device=x[0].device)
    return torch.full(shape, value.reshape(-1)[0].item(), dtype=value.dtype, device=x[0].device)


@register_op("Range", static_inputs=(0, 1, 2))
def _range(node: OpNode, x: Inputs) -> Tensor:
    start, limit, delta = (t.reshape(()) for t in x[:3])
    n = max(math.ceil((limit.item() - start.item()) / delta.item()), 0)
    steps = torch.arange(n, device=start.device, dtype=start.dtype)
    return start + steps * delta


@register_op("Expand", static_inputs=(1,))
def _expand(node: OpNode, x: Inputs) -> Tensor:
    shape = torch.broadcast_shapes(tuple(x[0].shape), tuple(_ints(x[1])))
    return x[0].expand(shape)


@register_op("Tile", static_inputs=(1,))
def _tile(node: OpNode, x: Inputs) -> Tensor:
    return x[0].repeat(_ints(x[1]))


@register_op("Dropout")
def _dropout(node: OpNode, x: Inputs) -> list[Tensor]:
    out = [x[0]]
    if node.num_outputs > 1:
        out.append(torch.ones_like(x[0], dtype=torch.bool))
    return out


@register_op("Pad", static_inputs=(1, 2, 3))
def _pad(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    rank = t.dim()
    mode = node.get("mode", "constant")
    if node.opset < 11:
        pads, value, axes = list(node.get("pads")), float(node.get("value", 0.0)), list(range(rank))
    else:
        pads = _ints(x[1])
        cv = _given(x, 2)
        value = cv.reshape(-1)[0].item() if cv is not None else 0.0
        axes = [_axis(a, rank) for a in _ints(_given(x, 3))] or list(range(rank))
    n = len(axes)
    begins, ends = [0] * rank, [0] * rank
    for i, a in enumerate(axes):
        begins[a], ends[a] = pads[i], pads[n + i]
    # F.pad lists from the last dim; drop leading all-zero dims (non-constant modes need few dims)
    first = next((d for d in range(rank) if begins[d] or ends[d]), rank)
    torch_pads = _torch_pads(begins[first:], ends[first:])
    if not torch_pads:
        return t
    if mode == "constant":
        return F.pad(t, torch_pads, value=value)
    torch_mode = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode]
    padded = rank - first
    if padded > 3:
        raise UnsupportedOpError(f"Pad node {node.name!r}: mode {mode!r} on more than 3 axes is not supported")
    # torch wants (batch, channel-like, *padded): fold the leading dims into one
    folded = t.reshape(math.prod(t.shape[:first]), *t.shape[first:])
    out_shape = [s + b + e for s, b, e in zip(t.shape, begins, ends)]
    return F.pad(folded, torch_pads, mode=torch_mode).reshape(out_shape)


@register_op("DepthToSpace")
def _depth_to_space(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    bs = node.get("blocksize")
    b, c, h, w = t.shape
    if node.get("mode", "DCR") == "DCR":
        y = t.reshape(b, bs, bs, c // bs**2, h, w).permute(0, 3, 4, 1, 5, 2)
    else:
        y = t.reshape(b, c // bs**2, bs, bs, h, w).permute(0, 1, 4, 2, 5, 3)
    return y.reshape(b, c // bs**2, h * bs, w * bs)


@register_op("SpaceToDepth")
def _space_to_depth(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    bs = node.get("blocksize")
    b, c, h, w = t.shape
    y = t.reshape(b, c, h // bs, bs, w // bs, bs).permute(0, 3, 5, 1, 2, 4)
    return y.reshape(b, c * bs * bs, h // bs, w // bs)


@register_op("NonZero")
def _nonzero(node: OpNode, x: Inputs) -> Tensor:
    return torch.nonzero(x[0]).T.contiguous()


@register_op("OneHot", static_inputs=(1, 2))
def _one_hot(node: OpNode, x: Inputs) -> Tensor:
    idx, depth, values = x[0].long(), int(_ints(x[1])[0]), x[2]
    idx = torch.where(idx < 0, idx + depth, idx)
    axis = node.get("axis", -1)
    hot = F.one_hot(idx.clamp(0, depth - 1), depth) * ((idx >= 0) & (idx < depth)).unsqueeze(-1)
    out = torch.where(hot.bool(), values[1], values[0])
    return out.movedim(-1, _axis(axis, out.dim()))


# --------------------------------------------------------------------------------------------
# Resize / Upsample
# --------------------------------------------------------------------------------------------


def _source_coords(mode: str, out_len: int, in_len: int, scale: np.float32, roi: tuple[float, float]) -> np.ndarray:
    """Source coordinate of every output index, in float32 like onnxruntime."""
    f = np.float32
    xr = np.arange(out_len, dtype=f)
    s = f(scale)
    if mode == "half_pixel":
        return (xr + f(0.5)) / s - f(0.5)
    if mode == "half_pixel_symmetric":
        adj = f(out_len) / (f(in_len) * s)
        offset = f(in_len) / f(2) * (f(1) - adj)
        return offset + (xr + f(0.5)) / s - f(0.5)
    if mode == "pytorch_half_pixel":
        return (xr + f(0.5)) / s - f(0.5) if out_len > 1 else np.zeros(out_len, f)
    if mode == "align_corners":
        return xr * f(in_len - 1) / f(out_len - 1) if out_len > 1 else np.zeros(out_len, f)
    if mode == "asymmetric":
        return xr / s
    if mode == "tf_crop_and_resize":
        start, end = f(roi[0]), f(roi[1])
        if out_len > 1:
            return start * f(in_len - 1) + xr * (end - start) * f(in_len - 1) / f(out_len - 1)
        return np.full(out_len, f(0.5) * (start + end) * f(in_len - 1), f)
    raise UnsupportedOpError(f"Resize coordinate_transformation_mode {mode!r} is not supported")


def _nearest(xo: np.ndarray, mode: str, scale: float) -> np.ndarray:
    if mode == "round_prefer_floor":
        return np.where(xo == np.trunc(xo) + np.float32(0.5), np.floor(xo), np.sign(xo) * np.floor(np.abs(xo) + 0.5))
    if mode == "round_prefer_ceil":
        return np.sign(xo) * np.floor(np.abs(xo) + 0.5)
    if mode == "floor":
        return np.floor(xo)
    if mode == "ceil":
        return np.ceil(xo)
    if mode == "simple":  # Upsample / Resize-10
        return np.ceil(xo) if scale < 1 else np.trunc(xo)
    raise UnsupportedOpError(f"Resize nearest_mode {mode!r} is not supported")


def _cubic_coeffs(t: np.ndarray, a: float, dtype=np.float32) -> np.ndarray:
    a = dtype(a)
    one = dtype(1)
    s = [t + one, t, one - t, dtype(2) - t]
    c0 = ((a * s[0] - 5 * a) * s[0] + 8 * a) * s[0] - 4 * a
    c1 = ((a + 2) * s[1] - (a + 3)) * s[1] * s[1] + one
    c2 = ((a + 2) * s[2] - (a + 3)) * s[2] * s[2] + one
    c3 = ((a * s[3] - 5 * a) * s[3] + 8 * a) * s[3] - 4 * a
    return np.stack([c0, c1, c2, c3], -1)


def _resize_axis(t: Tensor, axis: int, out_len: int, scale: float, roi, node: OpNode, mode: str):
    """Resize ``t`` along one axis; returns the tensor and an extrapolation mask (or None)."""
    in_len = t.shape[axis]
    ctm = node.get("coordinate_transformation_mode", "half_pixel" if node.op_type == "Resize" else "asymmetric")
    if node.op_type == "Upsample" or node.opset < 11:
        ctm = "asymmetric"
    xo = _source_coords(ctm, out_len, in_len, np.float32(scale), roi)
    dev = t.device
    outside = None
    if ctm == "tf_crop_and_resize":
        bad = (xo < 0) | (xo > in_len - 1)
        if bad.any():
            outside = torch.from_numpy(bad).to(dev)
    view = [1] * t.dim()
    view[axis] = out_len
    if mode == "nearest":
        nmode = "simple" if node.op_type == "Upsample" or node.opset < 11 else node.get("nearest_mode", "round_prefer_floor")
        idx = np.clip(_nearest(xo, nmode, scale), 0, in_len - 1).astype(np.int64)
        return t.index_select(axis, torch.from_numpy(idx).to(dev)), outside
    if mode == "linear":
        xc = np.clip(xo, 0, in_len - 1)
        lo = np.floor(xc).astype(np.int64)
        hi = np.minimum(lo + 1, in_len - 1)
        w = torch.from_numpy((xc - lo).astype(np.float32)).to(device=dev, dtype=t.dtype).reshape(view)
        a = t.index_select(axis, torch.from_numpy(lo).to(dev))
        b = t.index_select(axis, torch.from_numpy(hi).to(dev))
        return a + (b - a) * w, outside
    if mode == "cubic":
        base = np.floor(xo).astype(np.int64)
        coeffs = _cubic_coeffs((xo - base).astype(np.float32), node.get("cubic_coeff_a", -0.75))
        taps = base[:, None] + np.arange(-1, 3)[None, :]
        if node.get("exclude_outside", 0):
            inside = (taps >= 0) & (taps < in_len)
            coeffs = coeffs * inside
            coeffs = coeffs / coeffs.sum(-1, keepdims=True)
        taps = np.clip(taps, 0, in_len - 1)
        out = None
        for j in range(4):
            w = torch.from_numpy(coeffs[:, j].astype(np.float32)).to(device=dev, dtype=t.dtype).reshape(view)
            part = t.index_select(axis, torch.from_numpy(taps[:, j]).to(dev)) * w
            out = part if out is None else out + part
        return out, outside
    raise UnsupportedOpError(f"Resize node {node.name!r}: mode {mode!r} is not supported")


def _resize_check(node: OpNode, proto: onnx.NodeProto) -> str | None:
    if node.get("antialias", 0):
        return "antialias=1 is not supported"
    if node.get("mode", "nearest") not in ("nearest", "linear", "cubic", "bilinear", "trilinear"):
        return f"mode {node.get('mode')!r} is not supported"
    return None


@register_op("Resize", "Upsample", static_inputs=(1, 2, 3), check=_resize_check)
def _resize(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    rank = t.dim()
    mode = node.get("mode", "nearest")
    mode = "linear" if mode in ("bilinear", "trilinear") else mode
    roi_t = scales_t = sizes_t = None
    if node.op_type == "Upsample":
        scales_t = _given(x, 1) if node.opset >= 9 else torch.tensor(node.get("scales"))
    elif node.opset < 11:
        scales_t = _given(x, 1)
    else:
        roi_t, scales_t, sizes_t = _given(x, 1), _given(x, 2), _given(x, 3)
    axes = [_axis(a, rank) for a in node.get("axes", [])] or list(range(rank))
    in_shape = [t.shape[a] for a in axes]
    f = np.float32
    if sizes_t is not None:
        sizes = _ints(sizes_t)
        policy = node.get("keep_aspect_ratio_policy", "stretch")
        if policy == "stretch":
            scales = [f(o) / f(i) for o, i in zip(sizes, in_shape)]
        else:
            ratios = [f(o) / f(i) for o, i in zip(sizes, in_shape)]
            s = min(ratios) if policy == "not_larger" else max(ratios)
            scales = [s] * len(axes)
            sizes = [int(math.floor(float(s) * i + 0.5)) for i in in_shape]
    else:
        scales = [f(s) for s in _floats(scales_t)]
        if len(scales) == rank and len(axes) != rank:
            scales = [scales[a] for a in axes]
        sizes = []
        rois = _floats(roi_t)
        for k, (i, s) in enumerate(zip(in_shape, scales)):
            span = f(1)
            if node.get("coordinate_transformation_mode") == "tf_crop_and_resize" and rois:
                span = f(rois[len(axes) + k] - rois[k])
            sizes.append(int(f(i) * span * s))
    rois = _floats(roi_t)
    ctm = node.get("coordinate_transformation_mode", "half_pixel")
    outside_masks: list[Tensor] = []
    for k, (axis, out_len, scale) in enumerate(zip(axes, sizes, scales)):
        roi = (rois[k], rois[len(axes) + k]) if rois else (0.0, 1.0)
        if out_len == t.shape[axis] and scale == 1 and ctm != "tf_crop_and_resize":
            continue
        t, outside = _resize_axis(t, axis, out_len, scale, roi, node, mode)
        if outside is not None:
            view = [1] * rank
            view[axis] = out_len
            outside_masks.append(outside.reshape(view))
    if outside_masks:
        mask = outside_masks[0]
        for m in outside_masks[1:]:
            mask = mask | m
        t = torch.where(mask, torch.tensor(node.get("extrapolation_value", 0.0), dtype=t.dtype, device=t.device), t)
    return t


# --------------------------------------------------------------------------------------------
# the module
# --------------------------------------------------------------------------------------------


@dataclass
class _Step:
    spec: OpSpec
    node: OpNode
    inputs: list[str]
    outputs: list[str]
    release: list[str] = field(default_factory=list)


def _sanitise(name: str) -> str:
    s = re.sub(r"\W", "_", name)
    if not s or s[0].isdigit():
        s = "t_" + s
    return s


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 1


class TorchGraph(torch.nn.Module):
    """An ONNX graph as a ``torch.nn.Module`` (differentiable w.r.t. inputs, parameters and hooks).

    ``outputs``: tensor names to return (default: the graph outputs); any intermediate tensor works.
    ``inputs_at``: start evaluating from these intermediate tensors: only the sub-graph needed to
    compute ``outputs`` from them is kept; graph inputs that this sub-graph still reads (e.g. a
    shape branch from the image) remain inputs too. ``self.input_names`` is the resulting order of
    ``forward``'s positional arguments (``inputs_at`` first, then the graph inputs still needed).
    ``hooks``: ``{tensor_name: fn(tensor) -> tensor}`` applied the moment a tensor is produced (or
    fed, or read from an initializer); ``self.hooks`` may be changed between calls.
    ``return_dict``: forward returns ``{name: tensor}`` instead of a tuple in ``output_names`` order.

    Float initializers become ``nn.Parameter``s registered under sanitised names
    (``self.onnx_names`` maps attribute -> ONNX name, ``self.attr_names`` the reverse); a float
    initializer only read in a static slot (shape/scales/roi, Clip bounds, BatchNormalization
    mean/var) and every non-float one becomes a buffer, as do ``Constant`` node values. Unknown
    ops raise ``UnsupportedOpError`` at construction, listing all of them.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        outputs: Sequence[str] | None = None,
        inputs_at: Sequence[str] | None = None,
        hooks: Mapping[str, Callable[[Tensor], Tensor]] | None = None,
        *,
        return_dict: bool = False,
        base_dir: str = "",
    ) -> None:
        super().__init__()
        graph = model.graph
        opset = _opset(model)
        self.return_dict = return_dict
        self.hooks: dict[str, Callable[[Tensor], Tensor]] = dict(hooks or {})
        self.onnx_names: dict[str, str] = {}
        self.attr_names: dict[str, str] = {}
        self._sources: dict[str, str] = {}  # ONNX tensor -> attribute (initializers, Constant outputs)
        self._steps: list[_Step] = []
        self._feeds: set[str] = set()

        inits = {t.name: t for t in graph.initializer}
        producer: dict[str, int] = {}
        for i, n in enumerate(graph.node):
            for o in n.output:
                if o:
                    producer[o] = i
        graph_inputs = [v.name for v in graph.input if v.name not in inits]
        known = set(producer) | set(inits) | set(graph_inputs)
        self.output_names = list(outputs) if outputs is not None else [o.name for o in graph.output]
        feeds_at = list(inputs_at or [])
        for name in [*self.output_names, *feeds_at, *self.hooks]:
            if name not in known:
                raise ModelError(
                    f"tensor {name!r} is not in the graph {graph.name!r}: name a graph input, an initializer "
                    "or a node output"
                )

        # the nodes needed to compute the outputs from the feeds (backwards from the outputs)
        stop = set(feeds_at)
        needed_nodes: set[int] = set()
        needed_inputs: set[str] = set()
        used_inits: dict[str, set[bool]] = {}  # initializer -> {is it read in a static slot}
        stack = list(self.output_names)
        seen: set[str] = set()
        while stack:
            name = stack.pop()
            if not name or name in seen:
                continue
            seen.add(name)
            if name in stop:
                continue
            if name in inits:
                continue
            if name in producer:
                i = producer[name]
                if i not in needed_nodes:
                    needed_nodes.add(i)
                    stack.extend(graph.node[i].input)
                continue
            needed_inputs.add(name)
        self.input_names = feeds_at + [n for n in graph_inputs if n in needed_inputs]

        # topological order of the needed nodes (stable w.r.t. file order)
        order: list[int] = []
        available = set(self.input_names) | set(inits) | {""}
        pending = sorted(needed_nodes)
        while pending:
            rest = []
            for i in pending:
                if all(t in available for t in graph.node[i].input):
                    order.append(i)
                    available.update(graph.node[i].output)
                else:
                    rest.append(i)
            if len(rest) == len(pending):
                bad = graph.node[rest[0]]
                raise ModelError(
                    f"node {bad.name!r} ({bad.op_type}) reads a tensor nothing produces (or the graph has a "
                    "cycle): check the model with onnx.checker"
                )
            pending = rest

        # ops, checks
        problems: dict[str, list[str]] = {}
        steps: list[_Step] = []
        for i in order:
            p = graph.node[i]
            key = p.op_type if p.domain in ("", "ai.onnx") else f"{p.domain}::{p.op_type}"
            node = OpNode(
                name=p.name or (p.output[0] if p.output else f"node{i}"),
                op_type=p.op_type,
                attrs={a.name: _parse_attr(a) for a in p.attribute},
                num_outputs=len(p.output),
                opset=opset,
            )
            spec = OPS.get(p.op_type) if p.domain in ("", "ai.onnx") else None
            if spec is None:
                problems.setdefault(key, []).append(node.name)
                continue
            reason = spec.check(node, p) if spec.check else None
            if reason:
                problems.setdefault(f"{key} ({reason})", []).append(node.name)
                continue
            for slot, name in enumerate(p.input):
                if name in inits:
                    used_inits.setdefault(name, set()).add(slot in spec.static_inputs)
            steps.append(_Step(spec, node, list(p.input), list(p.output)))
        if problems:
            listed = "; ".join(
                f"{op} at node(s) {', '.join(repr(n) for n in names[:3])}{' ...' if len(names) > 3 else ''}"
                for op, names in problems.items()
            )
            raise UnsupportedOpError(
                f"the torch evaluator cannot run {len(problems)} op type(s) of this model: {listed}. "
                "Register a torch implementation with onnxprune.runtime.torch_eval.register_op, or "
                "simplify/re-export the model without these ops"
            )
        for name in self.output_names + list(self.hooks):
            if name in inits:
                used_inits.setdefault(name, set()).add(False)

        # initializers -> parameters / buffers; Constant nodes -> buffers (folded out of the steps)
        for name, slots in used_inits.items():
            value = _tensor_from_proto(inits[name], base_dir)
            attr = self._unique_attr(_sanitise(name))
            if value.is_floating_point() and False in slots:
                self.register_parameter(attr, torch.nn.Parameter(value))
            else:
                self.register_buffer(attr, value)
            self.onnx_names[attr] = name
            self.attr_names[name] = attr
            self._sources[name] = attr
        kept: list[_Step] = []
        for step in steps:
            if step.node.op_type == "Constant":
                attr = self._unique_attr("const_" + _sanitise(step.outputs[0]))
                self.register_buffer(attr, _constant_value(step.node).clone())
                self._sources[step.outputs[0]] = attr
            else:
                kept.append(step)

        # free every intermediate after its last reader
        keep = set(self.output_names)
        last: dict[str, int] = {}
        for k, step in enumerate(kept):
            for t in step.inputs:
                last[t] = k
            for t in step.outputs:
                last.setdefault(t, k)
        for t, k in last.items():
            if t and t not in keep:
                kept[k].release.append(t)
        self._steps = kept
        self._feeds = set(self.input_names)

    def _unique_attr(self, base: str) -> str:
        name, k = base, 0
        while hasattr(self, name):
            k += 1
            name = f"{base}_{k}"
        return name

    # ---------------------------------------------------------------- introspection

    def initializer(self, onnx_name: str) -> Tensor:
        """The parameter/buffer holding ONNX initializer ``onnx_name``."""
        return getattr(self, self.attr_names[onnx_name])

    def named_initializers(self) -> Iterator[tuple[str, Tensor]]:
        """``(onnx_name, tensor)`` for every initializer the evaluated sub-graph reads."""
        for onnx_name, attr in self.attr_names.items():
            yield onnx_name, getattr(self, attr)

    @property
    def op_types(self) -> list[str]:
        """Op types evaluated, in execution order (without folded Constants)."""
        return [s.node.op_type for s in self._steps]

    # ---------------------------------------------------------------- evaluation

    def _device(self) -> torch.device:
        for t in self.parameters():
            return t.device
        for t in self.buffers():
            return t.device
        return torch.device("cpu")

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Tensor]:
        """Evaluate with ``feeds`` by name; returns ``{output_name: tensor}``."""
        missing = [n for n in self.input_names if n not in feeds]
        unknown = [n for n in feeds if n not in self._feeds]
        if missing or unknown:
            raise TypeError(
                f"TorchGraph expects inputs {self.input_names}; missing {missing}, unexpected {unknown}"
            )
        hooks = self.hooks
        env: dict[str, Tensor] = {}
        for name, value in feeds.items():
            t = value if isinstance(value, Tensor) else torch.as_tensor(value, device=self._device())
            env[name] = hooks[name](t) if name in hooks else t
        for name, attr in self._sources.items():
            if name not in env:
                t = getattr(self, attr)
                env[name] = hooks[name](t) if name in hooks else t
        for step in self._steps:
            args = [env[n] if n else None for n in step.inputs]
            try:
                result = step.spec.fn(step.node, args)
            except UnsupportedOpError:
                raise
            except Exception as exc:  # add the node to torch's message
                shapes = [tuple(a.shape) if a is not None else None for a in args]
                raise RuntimeError(
                    f"evaluating node {step.node.name!r} ({step.node.op_type}) on inputs {shapes} failed: {exc}"
                ) from exc
            outs = [result] if isinstance(result, Tensor) else list(result)
            for name, t in zip(step.outputs, outs):
                if name and name not in self._feeds:
                    env[name] = hooks[name](t) if name in hooks else t
            for name in step.release:
                env.pop(name, None)
        return {name: env[name] for name in self.output_names}

    def forward(self, *args: Any, **named: Any) -> tuple[Tensor, ...] | dict[str, Tensor]:
        if len(args) > len(self.input_names):
            raise TypeError(f"TorchGraph takes {len(self.input_names)} inputs {self.input_names}, got {len(args)}")
        feeds = dict(zip(self.input_names, args))
        clash = set(feeds) & set(named)
        if clash:
            raise TypeError(f"input(s) {sorted(clash)} given both by position and by name")
        feeds.update(named)
        out = self.run(feeds)
        return out if self.return_dict else tuple(out[n] for n in self.output_names)


# --------------------------------------------------------------------------------------------
# write back
# --------------------------------------------------------------------------------------------


def write_back(model: onnx.ModelProto, torch_graph: TorchGraph, *, inplace: bool = False) -> onnx.ModelProto:
    """Copy ``torch_graph``'s parameters and buffers into the initializers of the same names
    (dtype and shape kept, nodes untouched); returns the model (a copy unless ``inplace``)."""
    out = model if inplace else _copy(model)
    inits = {t.name: t for t in out.graph.initializer}
    for onnx_name, tensor in torch_graph.named_initializers():
        proto = inits.get(onnx_name)
        if proto is None:
            raise ModelError(
                f"initializer {onnx_name!r} of the TorchGraph is not in the model: write back into the model "
                "the TorchGraph was built from"
            )
        dims = list(proto.dims)
        if list(tensor.shape) != dims:
            raise ModelError(
                f"initializer {onnx_name!r} has shape {dims} in the model but {list(tensor.shape)} in the "
                "TorchGraph: write_back cannot change shapes (rebuild the model instead)"
            )
        t = tensor.detach().to("cpu")
        if proto.data_type == TensorProto.BFLOAT16:
            new = helper.make_tensor(onnx_name, TensorProto.BFLOAT16, dims, t.float().reshape(-1).tolist())
        else:
            np_dtype = helper.tensor_dtype_to_np_dtype(proto.data_type)
            arr = t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()
            new = numpy_helper.from_array(np.ascontiguousarray(arr.astype(np_dtype, copy=False)), onnx_name)
        doc = proto.doc_string
        proto.CopyFrom(new)
        if doc:
            proto.doc_string = doc
    return out


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m
