"""Normalisations: BatchNormalization, InstanceNormalization, LayerNormalization, LRN."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.ops.registry import OpEntry, TorchLayer, register
from onnxprune.ir.graph import static_shape
from onnxprune.ops.roles import Blocked, Channelwise, Port, ResizeSite, Role, SliceSite, Span
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, axis_of, given


def _norm(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"{node.op} {node.name}: channels reach a parameter input")
    if axis != 1:
        return Blocked(f"{node.op} {node.name}: channels are not on axis 1")
    params = range(1, len(node.inputs)) if node.op == "BatchNormalization" else (1, 2)
    slices = [SliceSite(node.name, i, 0, repeat) for i in params]
    return Channelwise({("in", 0): (1, repeat), ("out", 0): (1, repeat)}, slices)


def _layer_norm_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """LayerNormalization normalises over the axes from ``axis`` on. Channels before them are normalised apart:
    channel-wise. Channels among them share the mean and variance, which a dropped channel, as a zero in the masked
    original, still counts in: the pruned node normalises its kept channels padded back with zeros to the original
    width, then slices them (``_pad_layer_norm``), exactly the masked original (ConvNeXt's and a transformer's
    streams; several groups in one norm, as where a Split cut the stream into ranges: EdgeNeXt's)."""
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"LayerNormalization {node.name}: channels reach a parameter input")
    shape = static_shape(node.inputs[0])
    if shape is None:
        return Blocked(f"LayerNormalization {node.name}: unknown shapes")
    first = axis_of(node.attrs.get("axis", -1), len(shape))
    ports = {("in", 0): (axis, repeat), ("out", 0): (axis, repeat)}
    if axis < first:
        return Channelwise(ports)
    params = [t for t in node.inputs[1:3] if t is not None and t.name]
    if any(len(t.outputs) and t.name for t in node.outputs[1:]) or repeat != 1 or shape[axis] is None:
        return Blocked(f"LayerNormalization {node.name}: its mean or deviation is an output, or the channels are "
                       "flattened")
    if any(len(p.shape or []) != len(shape) - first for p in params):
        return Blocked(f"LayerNormalization {node.name}: broadcasts its scale or bias over the channels")
    if not all(isinstance(p, gs.Constant) for p in params):
        return Blocked(f"LayerNormalization {node.name}: its scale or bias is computed, not a constant")
    slices = [SliceSite(node.name, i, axis - first, tensor=node.inputs[0].name) for i in range(1, 1 + len(params))]
    return Channelwise(ports, slices, resizes=[ResizeSite(node.name, node.inputs[0].name, axis, (0, shape[axis]))])


def _pad_layer_norm(node: gs.Node, site: ResizeSite, bounds: list[int], tag: int, graph: gs.Graph) -> None:
    """Normalise the kept channels padded with zeros to the original width (the scale and bias padded alike), then
    keep them: the statistics of the masked original, where every dropped channel is a zero. The mean and variance
    do not depend on where the zeros sit, so one pad at the end serves every group the norm holds: a later group's
    pruning replaces an earlier one's pad and slice."""
    x, out = node.inputs[0], node.outputs[0]
    pad = x.inputs[0] if len(x.inputs) == 1 and x.inputs[0].name.startswith(f"{node.name}.pad") else None
    if pad is not None:
        keep = out.outputs[0]
        x, out = pad.inputs[0], keep.outputs[0]
        keep.outputs.clear()
        node.inputs[0], node.outputs[0] = x, out
    kept, full = int(x.shape[site.axis]), site.bounds[1] - site.bounds[0]
    if kept == full:
        return
    rank = len(x.shape)
    pads = np.zeros(2 * rank, np.int64)
    pads[rank + site.axis] = full - kept
    padded = gs.Variable(f"{x.name}.padded{tag}", dtype=x.dtype)
    node.inputs[0] = padded
    first = axis_of(node.attrs.get("axis", -1), rank)
    for i in (1, 2):
        if len(node.inputs) > i and isinstance(node.inputs[i], gs.Constant):
            values = np.asarray(node.inputs[i].values)
            widths = [(0, full - values.shape[a] if a == site.axis - first else 0) for a in range(values.ndim)]
            node.inputs[i] = gs.Constant(f"{node.inputs[i].name}.padded{tag}", np.pad(values, widths))
    whole = gs.Variable(f"{out.name}.padded{tag}", dtype=out.dtype)
    node.outputs[0] = whole
    graph.nodes += [
        gs.Node("Pad", f"{node.name}.pad{tag}", inputs=[x, gs.Constant(f"{node.name}.pads{tag}", pads)],
                outputs=[padded]),
        gs.Node("Slice", f"{node.name}.keep{tag}", inputs=[whole, *(gs.Constant(f"{node.name}.{n}{tag}", np.array(
            [v], np.int64)) for n, v in (("starts", 0), ("ends", kept), ("axes", site.axis)))], outputs=[out]),
    ]


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
    layer=TorchLayer(("weight", "bias", "running_mean", "running_var"),
                     (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)),
))
register(OpEntry("InstanceNormalization", channels=_norm, torch={1: _instance_norm}))
register(OpEntry("LayerNormalization", channels=_layer_norm_rule, resize=_pad_layer_norm, torch={1: _layer_norm},
                 layer=TorchLayer(("weight", "bias"), (torch.nn.LayerNorm,))))
register(OpEntry("LRN", torch={1: _lrn}))
