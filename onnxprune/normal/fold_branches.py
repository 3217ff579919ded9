"""Pass: parallel branches over one input, summed, folded into one convolution (re-parameterisation).

RepVGG and MobileOne train each block as a sum over the same input ``x``: convolutions of several kernel sizes (each
maybe followed by its BatchNormalization), and an identity branch (``x`` itself, or a BatchNormalization of it).
Every branch is linear in ``x``, so the sum is one convolution: each kernel zero-padded to the largest, centred,
their sum, the identity as a centred one-hot kernel scaled per channel, the biases summed. The block then is the
plain convolution its deploy form has, which the analysis prunes like any other (as a sum of branches its channels
were a residual stream); the user gets the deploy graph, faster than the one they gave.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import const_value, static_shape
from onnxprune.ir.rewrite import matches, rewritten


@dataclass
class _Branch:
    """One term of the sum: ``weight`` (O, C/G, kh, kw) and ``bias`` (O,) of the convolution it is."""

    weight: np.ndarray
    bias: np.ndarray
    conv: gs.Node | None  # None: an identity branch
    strides: tuple[int, ...] = (1, 1)


def fold_branches(graph: gs.Graph) -> gs.Graph:
    """Replace every ``Add`` tree whose leaves are branches over one 4-D input (``_branch``: a Conv with constant
    weights and "same" padding, maybe followed by a BatchNormalization; the input itself; a BatchNormalization of it),
    with at least two branches and one Conv, all with the same group count and strides (an identity only at stride
    1 with as many outputs as inputs), by one Conv computing the sum.

    In place: ``graph`` is modified, then cleaned up and sorted; returns the same graph."""
    for add, (x, weight, bias, conv) in matches(graph, "Add", _foldable):
        out = add.outputs[0]
        add.outputs.clear()
        attrs = {k: v for k, v in conv.attrs.items() if k not in ("pads", "kernel_shape", "auto_pad")}
        pads = [(k - 1) // 2 for k in weight.shape[2:]] * 2
        graph.nodes.append(gs.Node("Conv", f"{out.name}.folded", {**attrs, "pads": pads,
                                                                  "kernel_shape": list(weight.shape[2:])},
                                   inputs=[x, gs.Constant(f"{out.name}.folded.weight", weight),
                                           gs.Constant(f"{out.name}.folded.bias", bias)], outputs=[out]))
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def has_branches(graph: gs.Graph) -> bool:
    """Whether ``fold_branches`` finds a sum of branches to fold in ``graph``."""
    return next(matches(graph, "Add", _foldable), None) is not None


def _foldable(add: gs.Node, outputs: set[str]) -> tuple[gs.Variable, np.ndarray, np.ndarray, gs.Node] | None:
    """(the input, the folded weight and bias, a Conv whose attributes the folded one keeps) of the Add tree whose
    root is ``add``, or None (an inner Add of a tree, or no sum of branches)."""
    if len(add.outputs) != 1 or any(user.op == "Add" and _private(add.outputs[0], outputs)
                                    for user in add.outputs[0].outputs):
        return None  # the root of the tree is the last Add
    leaves = _leaves(add, outputs)
    x = _common_input(leaves, outputs)
    if x is None:
        return None
    branches = [_branch(leaf, x, outputs) for leaf in leaves]
    folded = _fold(branches, x) if all(b is not None for b in branches) else None
    return None if folded is None else (x, *folded)


def _private(tensor: gs.Tensor, outputs: set[str]) -> bool:
    """Whether ``tensor`` has one reader and is none of the graph ``outputs`` (an inner Add of a tree, a branch's
    inner tensor)."""
    return len(tensor.outputs) == 1 and tensor.name not in outputs


def _leaves(add: gs.Node, outputs: set[str]) -> list[gs.Tensor]:
    """The tensors an Add tree sums: inputs of inner Adds whose outputs only it reads, recursively."""
    out = []
    for t in add.inputs:
        inner = t.inputs[0] if len(t.inputs) == 1 and t.inputs[0].op == "Add" and _private(t, outputs) else None
        out += _leaves(inner, outputs) if inner is not None else [t]
    return out


def _common_input(leaves: list[gs.Tensor], outputs: set[str]) -> gs.Variable | None:
    """The one 4-D tensor of a known channel count that every Conv among the branches (a leaf's producer, or that of
    its BatchNormalization's input where only the BatchNormalization reads it) reads; ``_branch`` then checks each
    leaf against it."""
    if len(leaves) < 2:
        return None
    reads = {}
    for leaf in leaves:
        node = leaf.inputs[0] if len(leaf.inputs) == 1 else None
        if node is not None and node.op == "BatchNormalization" and len(node.inputs[0].inputs) == 1 and \
                _private(node.inputs[0], outputs):
            node = node.inputs[0].inputs[0]
        if node is not None and node.op == "Conv":
            reads[node.inputs[0].name] = node.inputs[0]
    if len(reads) != 1:
        return None
    x = next(iter(reads.values()))
    shape = static_shape(x)  # the identity branch and the folded kernel need its channel count
    return x if isinstance(x, gs.Variable) and shape is not None and len(shape) == 4 and shape[1] else None


def _bn(node: gs.Node) -> tuple[np.ndarray, np.ndarray] | None:
    """A BatchNormalization in inference form as (scale, shift) per channel, or None."""
    values = [const_value(t) for t in node.inputs[1:5]]
    if len(values) != 4 or any(v is None for v in values) or len(node.outputs) != 1:
        return None
    gamma, beta, mean, var = (np.asarray(v, np.float64) for v in values)
    scale = gamma / np.sqrt(var + float(node.attrs.get("epsilon", 1e-5)))
    return scale, beta - mean * scale


def _branch(leaf: gs.Tensor, x: gs.Tensor, outputs: set[str]) -> _Branch | None:
    """The convolution ``leaf`` computes from ``x``: ``x`` itself, BatchNormalization(x), Conv(x), or
    BatchNormalization(Conv(x)), each intermediate read only by its Add; else None."""
    c = int(static_shape(x)[1])
    if leaf is x:
        return _Branch(_identity(np.ones(c), c), np.zeros(c), None)
    if len(leaf.inputs) != 1:
        return None
    node = leaf.inputs[0]
    post = None
    if node.op == "BatchNormalization":
        post = _bn(node)
        if post is None:
            return None
        if node.inputs[0] is x:
            return _Branch(_identity(post[0], c), post[1], None)
        if not (node.inputs[0].inputs and _private(node.inputs[0], outputs)):
            return None
        node = node.inputs[0].inputs[0]
    if node.op != "Conv" or node.inputs[0] is not x or not _private(node.outputs[0], outputs):
        return None
    weight = const_value(node.inputs[1])
    bias = const_value(node.inputs[2]) if len(node.inputs) > 2 else None
    if weight is None or weight.ndim != 4 or (len(node.inputs) > 2 and bias is None):
        return None
    kernel = weight.shape[2:]
    if any(k % 2 == 0 for k in kernel) or node.attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") or \
            any(d != 1 for d in node.attrs.get("dilations", [1, 1])) or \
            list(node.attrs.get("pads", [0, 0, 0, 0])) != [(k - 1) // 2 for k in kernel] * 2:
        return None
    weight = np.asarray(weight, np.float64)
    bias = np.zeros(len(weight)) if bias is None else np.asarray(bias, np.float64)
    if post is not None:
        weight, bias = weight * post[0][:, None, None, None], bias * post[0] + post[1]
    return _Branch(weight, bias, node, tuple(node.attrs.get("strides", [1, 1])))


def _identity(scale: np.ndarray, c: int) -> np.ndarray:
    """A 1x1 kernel (C, 1, 1, 1) placeholder of the identity scaled by ``scale``: expanded per group in ``_fold``."""
    return np.asarray(scale, np.float64).reshape(c, 1, 1, 1)


def _fold(branches: list[_Branch], x: gs.Tensor) -> tuple[np.ndarray, np.ndarray, gs.Node] | None:
    """(weight, bias, a Conv of the branches whose attributes the folded one keeps), or None where they do not
    share their group count and strides, or an identity cannot be one (stride ≠ 1, outputs ≠ inputs)."""
    convs = [b for b in branches if b.conv is not None]
    if not convs:
        return None
    groups = {int(b.conv.attrs.get("group", 1)) for b in convs}
    strides = {b.strides for b in convs}
    outs = {len(b.weight) for b in convs}
    if len(groups) != 1 or len(strides) != 1 or len(outs) != 1:
        return None
    (out,), c = outs, int(static_shape(x)[1])
    per_group = convs[0].weight.shape[1]
    if any(b.weight.shape[1] != per_group for b in convs):
        return None
    identities = [b for b in branches if b.conv is None]
    if identities and (strides.pop() != (1, 1) or out != c):
        return None
    size = [max(b.weight.shape[2 + i] for b in convs) for i in range(2)]
    weight, bias = np.zeros((out, per_group, *size)), np.zeros(out)
    for b in branches:
        bias += b.bias
        if b.conv is None:  # channel o reads input o, the (o mod C/G)-th of its group's
            o = np.arange(out)
            weight[o, o % per_group, size[0] // 2, size[1] // 2] += b.weight[:, 0, 0, 0]
            continue
        kh, kw = b.weight.shape[2:]
        top, left = (size[0] - kh) // 2, (size[1] - kw) // 2
        weight[:, :, top : top + kh, left : left + kw] += b.weight
    dtype = const_value(convs[0].conv.inputs[1]).dtype
    return weight.astype(dtype), bias.astype(dtype), convs[0].conv


def deploy_form(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its sums of branches folded (``fold_branches``), else ``model`` itself."""
    return rewritten(model, [(has_branches, fold_branches)])
