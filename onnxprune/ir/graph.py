"""Graph-surgeon helpers every floor reads: node names, constant values, static shapes, subgraph bodies."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxprune.ir.subgraphs import outer_reads


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


def with_metadata(model: onnx.ModelProto, source: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ``source``'s metadata (an exporter's class names, stride, image size: graph-surgeon's round
    trip drops them); mutated in place and returned."""
    del model.metadata_props[:]
    model.metadata_props.extend(source.metadata_props)
    return model


def rebuilt(model: onnx.ModelProto, initializer: list[onnx.TensorProto],
            inputs: list[onnx.ValueInfoProto] | None = None) -> onnx.ModelProto:
    """``model`` (its opsets, functions, producer and metadata, the graph's nodes, inputs, outputs and values) with
    ``initializer`` for its initializers and ``inputs`` appended to its inputs: built field by field, so that the
    weights left out are never copied."""
    graph = model.graph
    return onnx.ModelProto(
        ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions,
        producer_name=model.producer_name, producer_version=model.producer_version, domain=model.domain,
        model_version=model.model_version, doc_string=model.doc_string, metadata_props=model.metadata_props,
        graph=onnx.GraphProto(name=graph.name, doc_string=graph.doc_string, node=graph.node,
                              input=[*graph.input, *(inputs or [])], output=graph.output, value_info=graph.value_info,
                              initializer=initializer, sparse_initializer=graph.sparse_initializer))


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


def node_constant(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of a constant tensor, folded (``const_value``) or still a ``Constant`` node's output (a graph as
    exported, before the import folds them), else None."""
    value = const_value(tensor)
    node = tensor.inputs[0] if value is None and len(tensor.inputs) == 1 else None
    if node is not None and node.op == "Constant" and isinstance(node.attrs.get("value"), gs.Constant):
        value = np.asarray(node.attrs["value"].values)
    return value


def read_instead(old: gs.Tensor, new: gs.Tensor) -> None:
    """Make every node that reads ``old`` read ``new`` in its place (``old`` keeps its writer)."""
    for reader in list(old.outputs):
        for k, t in enumerate(list(reader.inputs)):
            if t is old:
                reader.inputs[k] = new


def shape_entry(tensor: gs.Tensor, index: int) -> int | None:
    """Entry ``index`` of a shape vector that is a constant or a Concat of pieces, None if unknown (computed at run
    time, as torch.onnx writes ``reshape(B, N, 3, heads, C // heads)``)."""
    value = node_constant(tensor)
    if value is not None:
        return int(value.reshape(-1)[index]) if index < value.size else None
    node = tensor.inputs[0] if isinstance(tensor, gs.Variable) and len(tensor.inputs) == 1 else None
    if node is None or node.op != "Concat":
        return None
    for piece in node.inputs:
        shape = static_shape(piece)
        if shape is None or len(shape) != 1 or shape[0] is None:
            return None
        if index < shape[0]:
            return shape_entry(piece, index)
        index -= shape[0]
    return None


def shape_producer(tensor: gs.Tensor) -> gs.Node | None:
    """The node producing ``tensor``, looking through Casts to integer types (shape arithmetic)."""
    node = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    while node is not None and node.op == "Cast" and np.dtype(
            onnx.helper.tensor_dtype_to_np_dtype(int(node.attrs["to"]))).kind in "iu":
        node = node.inputs[0].inputs[0] if len(node.inputs[0].inputs) == 1 else None
    return node


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


def large_constants(graph: gs.Graph, nbytes: int) -> dict[str, gs.Constant]:
    """The constants of ``graph`` of ``nbytes`` or more, read only by its own nodes (not graph inputs or outputs, not
    read inside a subgraph), dense (an array or a lazily imported tensor, whose values are not loaded here)."""
    inner = {t.name for node in graph.nodes for t in outer_reads(node)} | {t.name for t in [*graph.inputs, *graph.outputs]}
    return {name: t for name, t in graph.tensors().items()
            if isinstance(t, gs.Constant) and name not in inner and isinstance(t._values, (np.ndarray, LazyValues))
            and t._values.nbytes >= nbytes}  # both know their size


@contextmanager
def constants_aside(constants: Iterable[gs.Constant]) -> Iterator[None]:
    """Within the block, the node inputs that read ``constants`` read bare variables of their names instead (an
    export then names them without their values); put back on leaving."""
    swapped = []
    for tensor in constants:
        stand_in = gs.Variable(tensor.name)
        for node in list(tensor.outputs):
            for i, x in enumerate(node.inputs):
                if x is tensor:
                    node.inputs[i] = stand_in
                    swapped.append((node, i, tensor))
    try:
        yield
    finally:
        for node, i, tensor in swapped:
            node.inputs[i] = tensor


EXPORT_BYTES = 1 << 20
"""From this size ``export_model`` copies a constant into the model by itself."""


def export_model(graph: gs.Graph) -> onnx.ModelProto:
    """``gs.export_onnx(graph)`` to the byte, its large constants copied into the model one at a time: the
    exporter hands every initializer to one repeated-field ``extend``, which copies them about 18× slower (VGG-11's
    530 MB: 0.9 s against 0.05 s; a ``compress`` exports the whole graph five times)."""
    heavy = large_constants(graph, EXPORT_BYTES)
    if not heavy:
        return gs.export_onnx(graph)
    order = [name for name, t in graph.tensors().items() if isinstance(t, gs.Constant)
             and isinstance(t._values, (np.ndarray, LazyValues))]
    with constants_aside(heavy.values()):
        model = gs.export_onnx(graph)
    light = {t.name: _detached(t) for t in model.graph.initializer}  # small: copied out before the field is cleared
    del model.graph.initializer[:]
    for name in order:  # the exporter's order: every constant as the graph's tensors list them
        model.graph.initializer.add().CopyFrom(light[name] if name in light else
                                               OnnxExporter.export_tensor_proto(heavy[name]))
    return model


def _detached(proto: onnx.TensorProto) -> onnx.TensorProto:
    copy = onnx.TensorProto()
    copy.CopyFrom(proto)
    return copy
