"""Pass: an attention's fused q/k/v projection split into one projection each.

timm and most vision transformers compute ``qkv = x @ W + b`` (3·D outputs), reshape it to ``[..., 3, H, D/H]``, move
the 3 to the front and take q, k and v apart (``Split`` + ``Squeeze``, or a ``Gather`` each). The 3 and the heads then
share one axis of one tensor, so no channel space runs through the reshape. As three projections, each reshaped to
``[..., H, D/H]`` and transposed the same way, q, k and v carry the heads on one axis: the analysis finds the heads as
one group (q, k and v its producers, the attention's two MatMuls channel-wise in them, the output projection its
consumer), which prunes whole heads. The three computes what the one did, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import node_constant, shape_entry, static_shape
from onnxprune.ir.rewrite import matches, only_reader


@dataclass
class _Fused:
    matmul: gs.Node
    bias: np.ndarray | None
    heads: int
    width: int  # of a head
    perm: list[int]  # the 4-D transpose each of q, k, v takes: the fused one without the axis of the 3
    outputs: list[gs.Tensor]  # q, k, v as the graph reads them


def split_qkv(graph: gs.Graph) -> gs.Graph:
    """Replace every fused q/k/v projection (``_fused``) by three MatMuls (each with its bias ``Add``), Reshapes to
    ``[0, .., 0, H, D/H]`` and Transposes, writing the tensors q, k and v the graph read before.

    In place: ``graph`` is modified, then cleaned up and sorted; returns the same graph."""
    for node, fused in matches(graph, "MatMul", _fused):
        x, weight = node.inputs[0], np.asarray(node.inputs[1].values)
        lead = len(fused.perm) - 2  # the projection's input axes before its channels
        target = np.array([0] * lead + [fused.heads, fused.width], np.int64)  # each its own: pruning rewrites it
        dim = weight.shape[1] // 3
        for s, out in enumerate(fused.outputs):
            name = f"{node.name}.{'qkv'[s]}"
            y = gs.Variable(f"{name}.out", dtype=out.dtype)
            w = gs.Constant(f"{name}.weight", np.ascontiguousarray(weight[:, s * dim:(s + 1) * dim]))
            graph.nodes.append(gs.Node("MatMul", name, inputs=[x, w], outputs=[y]))
            if fused.bias is not None:
                biased = gs.Variable(f"{name}.biased", dtype=out.dtype)
                graph.nodes.append(gs.Node("Add", f"{name}.bias_add",
                                           inputs=[y, gs.Constant(f"{name}.bias", fused.bias[s * dim:(s + 1) * dim])],
                                           outputs=[biased]))
                y = biased
            split = gs.Variable(f"{name}.heads", dtype=out.dtype)
            graph.nodes.append(gs.Node("Reshape", f"{name}.reshape", inputs=[y, gs.Constant(f"{name}.shape", target)],
                                       outputs=[split]))
            for reader in list(out.inputs):
                reader.outputs.clear()
            graph.nodes.append(gs.Node("Transpose", f"{name}.transpose", {"perm": fused.perm}, inputs=[split],
                                       outputs=[out]))
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def has_fused_qkv(graph: gs.Graph) -> bool:
    """Whether ``split_qkv`` finds a fused q/k/v projection in ``graph``."""
    return next(matches(graph, "MatMul", _fused), None) is not None


def _fused(node: gs.Node, graph_outputs: set[str]) -> _Fused | None:
    """The fused projection starting at MatMul ``node``: a constant 2-D weight of 3·H·d columns, maybe a constant bias
    ``Add``, a ``Reshape`` to a constant ``[..., 3, H, d]``, a ``Transpose`` that brings the 3 to the front, then
    either one ``Split`` into three along it, each piece ``Squeeze``d, or three scalar ``Gather``s 0, 1, 2 of it."""
    weight = node.inputs[1] if len(node.inputs) == 2 else None
    if not isinstance(weight, gs.Constant) or len(weight.shape) != 2 or weight.shape[1] % 3:
        return None
    reader = only_reader(node.outputs[0], graph_outputs)
    bias = None
    if reader is not None and reader.op == "Add":
        other = [t for t in reader.inputs if t is not node.outputs[0]]
        value = node_constant(other[0]) if len(other) == 1 else None
        if value is None or value.shape != (weight.shape[1],):
            return None
        bias, reader = value, only_reader(reader.outputs[0], graph_outputs)
    if reader is None or reader.op != "Reshape":
        return None
    length = static_shape(reader.inputs[1])
    if length is None or len(length) != 1 or length[0] is None or length[0] < 4:
        return None
    target = [shape_entry(reader.inputs[1], i) for i in range(length[0])]  # None where computed at run time
    if reader.attrs.get("allowzero", 0) and 0 in target:  # a 0 that means 0, not "as the input"
        return None
    if target[-3] != 3 or not target[-2]:
        return None
    heads = int(target[-2])
    width = weight.shape[1] // 3 // heads
    if heads < 1 or 3 * heads * width != weight.shape[1] or target[-1] not in (None, width, -1):
        return None
    transpose = only_reader(reader.outputs[0], graph_outputs)
    rank = len(target)
    if transpose is None or transpose.op != "Transpose" or list(transpose.attrs.get("perm", []))[:1] != [rank - 3]:
        return None
    perm = [p - (p > rank - 3) for p in transpose.attrs["perm"][1:]]
    pieces = _pieces(transpose.outputs[0])
    if pieces is None or transpose.outputs[0].name in graph_outputs:
        return None
    return _Fused(node, bias, heads, width, perm, pieces)


def _pieces(tensor: gs.Tensor) -> list[gs.Tensor] | None:
    """q, k and v as read from ``tensor`` (the 3 on axis 0), or None where it is read another way: one ``Split`` into
    three, or a scalar ``Gather`` or a ``Slice`` of one index (``torch.export``'s unbind) each."""
    readers = tensor.outputs
    if len(readers) == 1 and readers[0].op == "Split" and int(readers[0].attrs.get("axis", 0)) == 0 \
            and len(readers[0].outputs) == 3:
        sizes = node_constant(readers[0].inputs[1]) if len(readers[0].inputs) > 1 else None
        split = readers[0].attrs.get("split")
        if (sizes is not None and sizes.tolist() != [1, 1, 1]) or (split is not None and list(split) != [1, 1, 1]):
            return None
        out = [_squeezed(piece) for piece in readers[0].outputs]
        return None if any(t is None for t in out) else out
    picks: dict[int, gs.Tensor] = {}
    for reader in readers:
        index, out = _picked(reader)
        if index is None or out is None or index in picks:
            return None
        picks[index] = out
    return [picks[s] for s in range(3)] if sorted(picks) == [0, 1, 2] else None


def _picked(reader: gs.Node) -> tuple[int | None, gs.Tensor | None]:
    """(s, the tensor read as the s-th of q, k, v) where ``reader`` takes index s of axis 0: a scalar ``Gather``, or a
    ``Slice`` [s, s+1) with constant parameters whose output is squeezed on axis 0; else (None, None)."""
    if reader.op == "Gather":
        index = node_constant(reader.inputs[1])
        if index is None or index.ndim != 0 or int(reader.attrs.get("axis", 0)) != 0:
            return None, None
        return int(index) % 3, reader.outputs[0]
    if reader.op != "Slice" or len(reader.inputs) < 4:
        return None, None
    params = [node_constant(t) for t in reader.inputs[1:]]
    if any(v is None or v.size != 1 for v in params):
        return None, None
    start, end, axis, step = (int(v.reshape(-1)[0]) for v in (*params, np.ones(1))[:4])
    if axis != 0 or step != 1 or end != start + 1 or not 0 <= start < 3:
        return None, None
    return start, _squeezed(reader.outputs[0])


def _squeezed(piece: gs.Tensor) -> gs.Tensor | None:
    """``piece`` (one of the 3, axis 0 of size 1) as its only reader, a ``Squeeze`` of axis 0, writes it; else None."""
    squeeze = piece.outputs[0] if len(piece.outputs) == 1 else None
    axes = None if squeeze is None or squeeze.op != "Squeeze" else (
        squeeze.attrs.get("axes") if "axes" in squeeze.attrs else node_constant(squeeze.inputs[1])
        if len(squeeze.inputs) > 1 else None)
    return squeeze.outputs[0] if axes is not None and np.asarray(axes).reshape(-1).tolist() == [0] else None
