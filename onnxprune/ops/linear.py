"""Gemm, MatMul, Einsum: channel rules, MACs, their weights as matrices, torch kernels."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import torch

from onnxprune.ir.graph import const_shape, const_value, static_shape
from onnxprune.ops.registry import Linear, Mixing, OpEntry, Shape, TorchLayer, product, register, set_bias
from onnxprune.ops.roles import Blocked, Channelwise, Consumer, Port, Producer, Role, SliceSite, Span, rank_of
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, given

# ---- channel rules


def _gemm_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    trans_a, trans_b = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    if const_shape(node.inputs[1]) is None or trans_a:
        return Blocked(f"Gemm {node.name}: non-constant weight or transA")
    if port == ("out", 0):
        slices = [SliceSite(node.name, 1, 0 if trans_b else 1, repeat)]
        if len(node.inputs) > 2:
            bias = const_value(node.inputs[2])
            if bias is None:
                return Blocked(f"Gemm {node.name}: non-constant bias")
            if bias.size > 1 and bias.shape[-1] > 1:
                slices.append(SliceSite(node.name, 2, bias.ndim - 1, repeat))
        return Producer(slices)
    if port == ("in", 0) and axis == 1:
        return Consumer("gemm", [SliceSite(node.name, 1, 1 if trans_b else 0, repeat)])
    return Blocked(f"Gemm {node.name}: channels reach an unsupported input")


def _matmul_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    weight = const_shape(node.inputs[1])
    if weight is None and const_shape(node.inputs[0]) is None:
        return _product_rule(node, port, axis, repeat)
    if weight is None or len(weight) != 2:
        return Blocked(f"MatMul {node.name}: weight is not a constant matrix")
    rank = rank_of(node.outputs[0] if port[0] == "out" else node.inputs[0])
    if rank is None or axis != rank - 1:
        return Blocked(f"MatMul {node.name}: channels are not on the last axis")
    if port == ("out", 0):
        return Producer([SliceSite(node.name, 1, 1, repeat)])
    if port == ("in", 0):
        return Consumer("matmul", [SliceSite(node.name, 1, 0, repeat)])
    return Blocked(f"MatMul {node.name}: channels reach the weight input")


def _product_rule(node: gs.Node, port: Port, axis: int, repeat: int) -> Role:
    """A MatMul of two computed tensors (an attention's q·kᵀ and attn·v): channel-wise in an axis both inputs batch
    over (an attention's heads), in the columns of the second input (v's channels, for attn·v) and in the rows of
    the first; the axis the product sums over mixes the channels of both, which no refit of one consumer undoes."""
    shapes = [static_shape(t) for t in (*node.inputs, node.outputs[0])]
    if any(s is None or len(s) < 2 for s in shapes) or len({len(s) for s in shapes}) != 1:
        return Blocked(f"MatMul {node.name}: a product of two computed tensors of unknown or unequal ranks")
    rank = len(shapes[0])
    at = {("in", 0): 0, ("in", 1): 1, ("out", 0): 2}.get(port)
    if at is None:
        return Blocked(f"MatMul {node.name}: channels reach an unsupported input")
    if axis < rank - 2:
        if len({s[axis] for s in shapes}) != 1:
            return Blocked(f"MatMul {node.name}: an input broadcasts over the channel axis")
        return Channelwise({p: (axis, repeat) for p in (("in", 0), ("in", 1), ("out", 0))})
    if (at, axis) in ((1, rank - 1), (2, rank - 1)):
        return Channelwise({("in", 1): (rank - 1, repeat), ("out", 0): (rank - 1, repeat)})
    if (at, axis) in ((0, rank - 2), (2, rank - 2)):
        return Channelwise({("in", 0): (rank - 2, repeat), ("out", 0): (rank - 2, repeat)})
    return Blocked(f"MatMul {node.name}: a product of two computed tensors sums over these channels (an "
                   "attention's q·kᵀ, a point cloud's x·xᵀ), which no refit of one consumer undoes; only whole heads "
                   "prune there, where q, k and v carry them on an axis of their own")


def _last_axis(node: gs.Node) -> int | None:
    shape = static_shape(node.outputs[0])
    return None if shape is None else len(shape) - 1


def _dot_macs(node: gs.Node, inp: Shape, out: Shape) -> int:
    """Every output entry is a dot product over the reduced dimension."""
    k = inp[0] if int(node.attrs.get("transA", 0)) else inp[-1]
    return product(out[1:], node) * product([k], node)


# ---- the weights as matrices (see analysis.consumers)


def _rows(node: gs.Node, y: torch.Tensor) -> torch.Tensor:
    """(..., channels) -> (1, channels, positions)."""
    return y.reshape(-1, y.shape[-1]).T.unsqueeze(0)


def bias_add(node: gs.Node) -> gs.Node | None:
    """The bias ``Add`` that ``write`` put after a MatMul consumer (a MatMul has no bias input), if any."""
    out = node.outputs[0]
    if node.op != "MatMul" or len(out.outputs) != 1:
        return None
    add = out.outputs[0]
    if add.op != "Add" or add.name != f"{node.name}.bias_add" or add.inputs[0] is not out:
        return None
    return add


def _gemm_matrix(node: gs.Node, w: np.ndarray) -> Linear:
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    w = alpha * (w if int(node.attrs.get("transB", 0)) else w.T)
    bias = np.zeros(w.shape[0])
    if len(node.inputs) > 2:
        bias = bias + beta * const_value(node.inputs[2]).astype(np.float64).reshape(-1)
    return Linear(w, bias, 1)


def _matmul_matrix(node: gs.Node, w: np.ndarray) -> Linear:
    add = bias_add(node)
    bias = np.zeros(w.shape[1]) if add is None else const_value(add.inputs[1]).astype(np.float64)
    return Linear(w.T, bias, 1)


def _gemm_write(graph: gs.Graph, node: gs.Node, w: np.ndarray, b: np.ndarray) -> None:
    trans_b = int(node.attrs.get("transB", 0))
    node.inputs[1] = gs.Constant(f"{node.name}.weight", w if trans_b else np.ascontiguousarray(w.T))
    node.attrs["alpha"], node.attrs["beta"] = 1.0, 1.0
    set_bias(node, b)


def _matmul_write(graph: gs.Graph, node: gs.Node, w: np.ndarray, b: np.ndarray) -> None:
    """A MatMul has no bias input: a bias goes into an ``Add`` after it (``bias_add``)."""
    name = node.name
    node.inputs[1] = gs.Constant(f"{name}.weight", np.ascontiguousarray(w.T))
    add = bias_add(node)
    if add is not None:  # written before: update that bias rather than stacking a second Add
        add.inputs[1] = gs.Constant(f"{name}.bias", b)
    elif np.any(b != 0):
        out = node.outputs[0]
        # no shape: it would go stale when a later group slices this MatMul's output channels
        mid = gs.Variable(f"{name}.matmul_out", dtype=out.dtype)
        node.outputs[0] = mid
        graph.nodes.append(gs.Node("Add", f"{name}.bias_add", inputs=[mid, gs.Constant(f"{name}.bias", b)],
                                   outputs=[out]))


# ---- torch kernels


def _gemm(node: OpNode, x: Inputs) -> Tensor:
    a, b, c = x[0], x[1], given(x, 2)
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


def _matmul(node: OpNode, x: Inputs) -> Tensor:
    return torch.matmul(x[0], x[1])


def _einsum(node: OpNode, x: Inputs) -> Tensor:
    return torch.einsum(node.get("equation"), *x)


register(OpEntry("Gemm", channels=_gemm_rule, macs=_dot_macs, mixing=Mixing(_gemm_matrix, _rows, _rows, _gemm_write),
                 torch={1: _gemm}, layer=TorchLayer(("weight", "bias"), (torch.nn.Linear,))))
register(OpEntry("MatMul", channels=_matmul_rule, macs=_dot_macs,
                 mixing=Mixing(_matmul_matrix, _rows, _rows, _matmul_write, bias_input=None, axis=_last_axis),
                 torch={1: _matmul}, layer=TorchLayer(("weight",), (torch.nn.Linear,))))
register(OpEntry("Einsum", torch={1: _einsum}))
