"""Pass: a LayerNorm written out as elementwise ops fused into one ``LayerNormalization``.

Exports write a norm over one axis as ``μ = ReduceMean(x)``, ``d = x - μ``, ``ReduceMean(d²)``, ``+ ε``, ``Sqrt``,
``d / ·`` (a channels-first LayerNorm at any opset, EdgeNeXt's and ConvNeXt's downsampling norms; every LayerNorm
below opset 17). The two means reduce across the channels, so no channel space ran through them. As one
``LayerNormalization`` over the last axis (a ``Transpose`` there and back where the axis is another), the norm's own
channel rule prunes it: kept channels padded back with zeros, the masked original's statistics. The scale is ones;
the written-out scale and bias, per-channel ``Mul`` and ``Add`` after the ``Div``, stay as they are. At any opset:
onnxruntime runs the node below 17 as well (its own kernel in the ONNX domain), and a model written below 17 has it
written out again (``write_layer_norm``).
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import static_shape
from onnxprune.ir.rewrite import matches
from onnxprune.ops.reduce import written_layer_norm


def fuse_layer_norm(graph: gs.Graph) -> gs.Graph:
    """Replace every written-out norm (``ops.reduce.written_layer_norm``) by ``LayerNormalization`` with a scale of
    ones, named as its first ``ReduceMean`` was, transposed to and from the last axis where it normalises another,
    writing the tensor the ``Div`` wrote.

    In place: ``graph`` is modified, then cleaned up and sorted; returns the same graph."""
    for node, found in matches(graph, "ReduceMean", written_layer_norm):
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
        node.name = f"{name}.written"  # unread now, removed below; the norm takes its name (``write_layer_norm``
        # writes it back under it, so that a result fused again matches the model it was pruned from)
        normed = out if last else gs.Variable(f"{name}.normed", dtype=x.dtype)
        scale = gs.Constant(f"{name}.scale", np.ones(channels, dtype))
        graph.nodes.append(gs.Node("LayerNormalization", name,
                                   {"axis": -1, "epsilon": found.epsilon}, inputs=[source, scale], outputs=[normed]))
        if not last:
            graph.nodes.append(gs.Node("Transpose", f"{name}.from_last", {"perm": list(np.argsort(perm))},
                                       inputs=[normed], outputs=[out]))
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def has_written_layer_norm(graph: gs.Graph) -> bool:
    """Whether ``fuse_layer_norm`` finds a written-out norm in ``graph``."""
    return next(matches(graph, "ReduceMean", written_layer_norm), None) is not None
