"""Pass: a channels-last flatten into a matrix product, read channels first.

Keras and TF exports run convolutions on NCHW and transpose back to NHWC before ``Flatten → MatMul``
(``Transpose(perm=[0, 2, 3, 1]) → Flatten → MatMul(W)``, MTCNN's O-net). There each channel sits at a fixed stride
of the flattened vector, so pruning a channel removes a strided set of W's rows. Dropping the Transpose and
reordering W's rows channel-major (row ``c·S + s`` ← row ``s·C + c``) computes the same product, and the head then
is the ``Flatten → MatMul`` consumer every NCHW export has.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import const_shape, const_value, static_shape
from onnxprune.ir.rewrite import rewritten


def flatten_channels_first(graph: gs.Graph) -> gs.Graph:
    """Rewrite every ``Transpose([0, 2, .., 1]) → Flatten(axis=1) → MatMul/Gemm`` whose flattened vector is read
    only by products with constant weights (MatMul's second input; Gemm's B, without transA).

    In place: ``graph`` is modified, then cleaned up and sorted; returns the same graph."""
    for node in list(graph.nodes):
        flat = _flatten_after(node)
        if flat is None:
            continue
        shape = static_shape(node.inputs[0])
        channels, spatial = int(shape[1]), int(np.prod(shape[2:]))
        order = np.arange(spatial * channels).reshape(spatial, channels).T.reshape(-1)
        for user in list(flat.outputs[0].outputs):
            transposed = user.op == "Gemm" and int(user.attrs.get("transB", 0))
            weight = np.asarray(const_value(user.inputs[1]))
            reordered = weight[:, order] if transposed else weight[order]
            user.inputs[1] = gs.Constant(f"{user.inputs[1].name}.channels_first", np.ascontiguousarray(reordered))
        flat.inputs[0] = node.inputs[0]
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def _flatten_after(node: gs.Node) -> gs.Node | None:
    """The Flatten that reads only ``node``'s output when ``node`` moves axis 1 last and every reader of the
    flattened vector is a product with a constant weight of its length, else None."""
    shape = static_shape(node.inputs[0]) if node.op == "Transpose" else None
    if shape is None or len(shape) < 3 or None in shape[1:]:
        return None
    if list(node.attrs.get("perm", [])) != [0, *range(2, len(shape)), 1] or len(node.outputs[0].outputs) != 1:
        return None
    flat = node.outputs[0].outputs[0]
    if flat.op != "Flatten" or int(flat.attrs.get("axis", 1)) != 1 or not flat.outputs[0].outputs:
        return None
    size = int(np.prod(shape[1:]))
    for user in flat.outputs[0].outputs:
        weight = const_shape(user.inputs[1]) if len(user.inputs) > 1 and user.inputs[0] is flat.outputs[0] else None
        if user.op not in ("MatMul", "Gemm") or weight is None or len(weight) != 2 or int(user.attrs.get("transA", 0)):
            return None
        if weight[1 if user.op == "Gemm" and int(user.attrs.get("transB", 0)) else 0] != size:
            return None
    return flat


def has_channels_last_head(graph: gs.Graph) -> bool:
    """Whether ``flatten_channels_first`` finds a head to rewrite in ``graph``."""
    return any(_flatten_after(node) for node in graph.nodes)


def channels_first_heads(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ``flatten_channels_first`` applied when it has such a head, else ``model`` itself."""
    return rewritten(model, [(has_channels_last_head, flatten_channels_first)])
