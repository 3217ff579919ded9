"""Graph-surgeon helpers every floor reads: node names, constant values, static shapes, subgraph bodies."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs


def restore_subgraphs(model: onnx.ModelProto, original: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the graph attributes (Loop/If/Scan bodies) of each top-level node copied byte for byte
    from the node of ``original`` that writes the same first output: graph-surgeon's round trip rewrites
    bodies, and the tool never changes them."""
    bodies = {n.output[0]: n.attribute for n in original.graph.node if n.output
              and any(a.type == onnx.AttributeProto.GRAPH for a in n.attribute)}
    for node in model.graph.node:
        source = bodies.get(node.output[0]) if node.output else None
        if source is None:
            continue
        by_name = {a.name: a for a in source if a.type == onnx.AttributeProto.GRAPH}
        for attr in node.attribute:
            if attr.name in by_name:
                attr.CopyFrom(by_name[attr.name])
    return model


def rebuilt(model: onnx.ModelProto, initializer: list[onnx.TensorProto],
            inputs: list[onnx.ValueInfoProto] | None = None) -> onnx.ModelProto:
    """What onnx and onnxruntime read of ``model`` (opsets, functions, the graph's nodes, inputs, outputs and
    values), with ``initializer`` for its initializers and ``inputs`` appended to its inputs: built field by field,
    so that the weights left out are never copied."""
    graph = model.graph
    return onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions,
                           graph=onnx.GraphProto(
        name=graph.name, node=graph.node, input=[*graph.input, *(inputs or [])], output=graph.output,
        value_info=graph.value_info, initializer=initializer, sparse_initializer=graph.sparse_initializer))


def name_nodes(graph: gs.Graph) -> gs.Graph:
    """Give every node a unique name (passes and reports address nodes by name)."""
    seen: set[str] = set()
    for i, node in enumerate(graph.nodes):
        name = node.name or f"{node.op}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        node.name = name
        seen.add(name)
    return graph


def const_value(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of a constant tensor (initializer or folded Constant), else None."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    return None


def const_shape(tensor: gs.Tensor) -> tuple[int, ...] | None:
    """The shape of a constant tensor without loading its values (a lazily imported weight stays on disk or in the
    proto: VGG-11's 411 MB classifier was loaded at each of the analysis's 18 visits), else None."""
    return tuple(int(d) for d in tensor.shape) if isinstance(tensor, gs.Constant) else None


def loaded(graph: gs.Graph) -> gs.Graph:
    """``graph`` with every constant's values read in, in place: its copies then share the arrays, where each copy of
    a lazily imported constant would read them again (VGG-11's 530 MB, once per session of a compress)."""
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Constant):
            tensor.values  # noqa: B018 - the property reads lazily imported values and keeps them
    return graph


def static_shape(tensor: gs.Tensor) -> list[int | None] | None:
    """Tensor shape with dynamic dims as None, or None when the rank is unknown."""
    if tensor.shape is None:
        return None
    return [d if isinstance(d, (int, np.integer)) and d >= 0 else None for d in tensor.shape]
