"""Pass: a LayerNorm written out as elementwise ops fused into one ``LayerNormalization``.

Exports write a norm over one axis as ``μ = ReduceMean(x)``, ``d = x - μ``, ``ReduceMean(d²)``, ``+ ε``, ``Sqrt``,
``d / ·`` (a channels-first LayerNorm at any opset, EdgeNeXt's and ConvNeXt's downsampling norms; every LayerNorm
below opset 17). The two means reduce across the channels, so no channel space ran through them. As one
``LayerNormalization`` over the last axis (a ``Transpose`` there and back where the axis is another), the norm's own
channel rule prunes it: kept channels padded back with zeros, the masked original's statistics. The scale is ones;
the written-out scale and bias, per-channel ``Mul`` and ``Add`` after the ``Div``, stay as they are. Only where the
model's opset has ``LayerNormalization`` (17 on): below it, the norm stays written out and blocks its channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import node_constant, static_shape
from onnxprune.ir.rewrite import matches, only_reader

OPSET = 17  # the first opset with LayerNormalization


@dataclass
class _Written:
    x: gs.Tensor
    axis: int  # non-negative
    rank: int
    epsilon: float
    out: gs.Tensor  # the Div's output: the normalised x


def fuse_layer_norm(graph: gs.Graph) -> gs.Graph:
    """Replace every written-out norm (``_written``) by ``LayerNormalization`` with a scale of ones, transposed to and
    from the last axis where it normalises another, writing the tensor the ``Div`` wrote.

    In place: ``graph`` is modified, then cleaned up and sorted; returns the same graph."""
    for node, found in matches(graph, "ReduceMean", _written) if graph.opset >= OPSET else ():
        name, x, out = node.name, found.x, found.out
        channels = static_shape(x)[found.axis]
        dtype = np.dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)
        last = found.axis == found.rank - 1
        perm = [a for a in range(found.rank) if a != found.axis] + [found.axis]
        source = x
        if not last:
            source = gs.Variable(f"{name}.to_last", dtype=x.dtype)
            graph.nodes.append(gs.Node("Transpose", f"{name}.to_last", {"perm": perm}, inputs=[x], outputs=[source]))
        for writer in list(out.inputs):
            writer.outputs.clear()
        normed = out if last else gs.Variable(f"{name}.normed", dtype=x.dtype)
        scale = gs.Constant(f"{name}.scale", np.ones(channels, dtype))
        graph.nodes.append(gs.Node("LayerNormalization", f"{name}.layer_norm",
                                   {"axis": -1, "epsilon": found.epsilon}, inputs=[source, scale], outputs=[normed]))
        if not last:
            graph.nodes.append(gs.Node("Transpose", f"{name}.from_last", {"perm": list(np.argsort(perm))},
                                       inputs=[normed], outputs=[out]))
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def has_written_layer_norm(graph: gs.Graph) -> bool:
    """Whether ``fuse_layer_norm`` finds a written-out norm in ``graph`` (none below opset 17)."""
    return graph.opset >= OPSET and next(matches(graph, "ReduceMean", _written), None) is not None


def _axis(node: gs.Node, rank: int) -> int | None:
    """The one axis a keepdims ``ReduceMean`` reduces (its attribute, or its input from opset 18), else None."""
    if not node.attrs.get("keepdims", 1):
        return None
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        axes = node_constant(node.inputs[1])
    axes = None if axes is None else np.asarray(axes).reshape(-1).tolist()
    return None if axes is None or len(axes) != 1 else int(axes[0]) % rank


def _reader(tensor: gs.Tensor, op: str, outputs: set[str]) -> gs.Node | None:
    node = only_reader(tensor, outputs)
    return node if node is not None and node.op == op else None


def _scalar(tensor: gs.Tensor) -> float | None:
    value = node_constant(tensor)
    return None if value is None or value.size != 1 else float(value.reshape(-1)[0])


def _written(mean: gs.Node, outputs: set[str]) -> _Written | None:
    """The norm starting at ``mean``: ``ReduceMean(x)`` over one axis read only by ``d = Sub(x, ·)``; ``d`` read only
    by ``Pow(d, 2)`` (or ``Mul(d, d)``) and ``Div(d, ·)``; then ``ReduceMean`` over the same axis, ``Add`` of a scalar
    ε, ``Sqrt``, into that ``Div``; none of it a graph output."""
    shape = static_shape(mean.inputs[0])
    if shape is None:
        return None
    x, axis = mean.inputs[0], _axis(mean, len(shape))
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
    add = None if var is None or _axis(var, len(shape)) != axis else _reader(var.outputs[0], "Add", outputs)
    if add is None:
        return None
    epsilon = next((e for e in map(_scalar, add.inputs) if e is not None), None)
    sqrt = _reader(add.outputs[0], "Sqrt", outputs)
    if epsilon is None or sqrt is None or _reader(sqrt.outputs[0], "Div", outputs) is not div or div.inputs[0] is not d:
        return None
    return _Written(x, axis, len(shape), epsilon, div.outputs[0])
