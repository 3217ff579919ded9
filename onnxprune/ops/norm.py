"""Normalisations: BatchNormalization, InstanceNormalization, LayerNormalization, LRN."""

from __future__ import annotations

import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Role, SliceSite, Span
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, axis_of, given


def _norm(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"{node.op} {node.name}: channels reach a parameter input")
    if axis != 1:
        return Blocked(f"{node.op} {node.name}: channels are not on axis 1")
    params = range(1, len(node.inputs)) if node.op == "BatchNormalization" else (1, 2)
    slices = [SliceSite(node.name, i, 0, repeat) for i in params]
    return Channelwise({("in", 0): (1, repeat), ("out", 0): (1, repeat)}, slices)


def _batch_norm(node: OpNode, x: Inputs) -> Tensor:
    t, scale, bias, mean, var = x[:5]
    return F.batch_norm(t, mean, var, scale, bias, False, 0.0, node.get("epsilon", 1e-5))


def _instance_norm(node: OpNode, x: Inputs) -> Tensor:
    return F.instance_norm(x[0], weight=x[1], bias=x[2], eps=node.get("epsilon", 1e-5))


def _layer_norm(node: OpNode, x: Inputs) -> Tensor:
    t, scale, bias = x[0], x[1], given(x, 2)
    axis = axis_of(node.get("axis", -1), t.dim())
    dims = tuple(range(axis, t.dim()))
    mean = t.mean(dims, keepdim=True)
    var = (t - mean).square().mean(dims, keepdim=True)
    y = (t - mean) * torch.rsqrt(var + node.get("epsilon", 1e-5)) * scale
    return y + bias if bias is not None else y


def _lrn(node: OpNode, x: Inputs) -> Tensor:
    return F.local_response_norm(
        x[0], node.get("size"), node.get("alpha", 1e-4), node.get("beta", 0.75), node.get("bias", 1.0)
    )


register(OpEntry(
    "BatchNormalization", channels=_norm, torch={1: _batch_norm}, static_inputs=frozenset({3, 4}),
    check=lambda n, p: "training_mode=1 (export the model in eval mode)" if n.get("training_mode", 0) else None,
))
register(OpEntry("InstanceNormalization", channels=_norm, torch={1: _instance_norm}))
register(OpEntry("LayerNormalization", torch={1: _layer_norm}))
register(OpEntry("LRN", torch={1: _lrn}))
