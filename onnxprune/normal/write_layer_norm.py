"""Pass: every ``LayerNormalization`` written out as elementwise ops where the model's opset has none (below 17).

The loader fuses written-out norms at any opset (``fuse_layer_norm``) so that their channels prune, and onnxruntime
runs the fused node below opset 17 too (its own kernel in the ONNX domain); the ONNX standard and other runtimes
(TensorRT) have no such op there. A model written below opset 17 gets each norm written out again, as exports write
it: ``μ = ReduceMean(x)`` over the normalised axes, ``d = x - μ``, ``ReduceMean(d·d)``, ``+ ε``, ``Sqrt``,
``d / ·``, then ``Mul`` by the scale (where it is not all ones) and ``Add`` of the bias, in x's own type.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

OPSET = 17  # the first opset with LayerNormalization


def write_layer_norm(graph: gs.Graph) -> gs.Graph:
    """Below opset 17, replace every ``LayerNormalization`` whose mean and deviation outputs nothing reads by the
    elementwise ops above (a norm over axes counted from the front needs x's rank: left as it is without one).

    In place: ``graph`` is modified, then cleaned up and sorted; returns the same graph."""
    outputs, taken = {t.name for t in graph.outputs}, {n.name for n in graph.nodes} | set(graph.tensors())
    for node in [n for n in graph.nodes if n.op == "LayerNormalization"] if graph.opset < OPSET else ():
        axes = _axes(node, outputs)
        if axes is not None:
            graph.nodes.remove(node)
            graph.nodes.extend(_written_out(node, axes, taken))
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def _written_out(node: gs.Node, axes: list[int], taken: set[str]) -> list[gs.Node]:
    """The ops that compute ``node``'s normalised output over ``axes``, writing its output tensor, the first one
    named as ``node`` (``fuse_layer_norm`` names the norm after it: fused again, the norm has its name), the other
    nodes and the tensors by names not in ``taken`` (added to it); ``node`` is disconnected from it."""
    x, out, name = node.inputs[0], node.outputs[0], node.name

    def fresh(suffix: str) -> str:
        candidates = (f"{name}.{suffix}{k or ''}" for k in range(len(taken) + 1))
        found = next(c for c in candidates if c not in taken)
        taken.add(found)
        return found

    dtype = np.dtype(x.dtype) if x.dtype is not None else np.dtype(np.float32)
    mean, d, square, variance, shifted, deviation, normed = (gs.Variable(fresh(s), dtype=x.dtype) for s in (
        "mean", "centred", "square", "variance", "shifted", "deviation", "normed"))
    epsilon = gs.Constant(fresh("epsilon_value"), np.array(node.attrs.get("epsilon", 1e-5), dtype))
    nodes = [
        gs.Node("ReduceMean", name, {"axes": axes, "keepdims": 1}, inputs=[x], outputs=[mean]),
        gs.Node("Sub", fresh("centre"), inputs=[x, mean], outputs=[d]),
        gs.Node("Mul", fresh("squaring"), inputs=[d, d], outputs=[square]),
        gs.Node("ReduceMean", fresh("mean_square"), {"axes": axes, "keepdims": 1}, inputs=[square],
                outputs=[variance]),
        gs.Node("Add", fresh("epsilon"), inputs=[variance, epsilon], outputs=[shifted]),
        gs.Node("Sqrt", fresh("sqrt"), inputs=[shifted], outputs=[deviation]),
        gs.Node("Div", fresh("divide"), inputs=[d, deviation], outputs=[normed]),
    ]
    scale = node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
    for op, param in (("Mul", None if _ones(scale) else scale), ("Add", bias)):
        if param is not None:
            result = gs.Variable(fresh("scaled" if op == "Mul" else "shifted"), dtype=x.dtype)
            nodes.append(gs.Node(op, fresh(op.lower()), inputs=[nodes[-1].outputs[0], param], outputs=[result]))
    node.outputs.clear()
    nodes[-1].outputs = [out]
    return nodes


def has_layer_norm_below_opset(graph: gs.Graph) -> bool:
    """Whether ``write_layer_norm`` finds a norm to write out in ``graph``."""
    outputs = {t.name for t in graph.outputs}
    return graph.opset < OPSET and any(n.op == "LayerNormalization" and _axes(n, outputs) is not None
                                       for n in graph.nodes)


def _axes(node: gs.Node, outputs: set[str]) -> list[int] | None:
    """The axes ``node`` normalises, negative where its axis is (None: its mean or deviation is read, or its axis
    counts from the front of an input of unknown rank)."""
    if any(t.outputs or t.name in outputs for t in node.outputs[1:]):
        return None
    axis, rank = int(node.attrs.get("axis", -1)), len(node.inputs[0].shape or []) or None
    if axis < 0:
        return list(range(axis, 0))
    return None if rank is None else list(range(axis, rank))


def _ones(tensor: gs.Tensor) -> bool:
    return isinstance(tensor, gs.Constant) and bool(np.all(np.asarray(tensor.values) == 1))
