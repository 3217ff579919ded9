"""Loading an ONNX file into a normalised graph-surgeon graph that the analysis can read."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError
from onnx_graphsurgeon.importers.onnx_importer import OnnxImporter
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxprune.errors import ModelError
from onnxprune.ir.graph import EXPORT_BYTES, constants_aside, large_constants, name_nodes
from onnxprune.ir.ort import held_bytes, in_memory, stubbed
from onnxprune.ir.shapes import (copy_batch_dims, fold_shape_values, infer_shapes, onnx_infer, resize_by_scales,
                                  weight_type, without_weights)


def load_model(path: str | Path) -> onnx.ModelProto:
    """Read and check an ONNX file; every failure is a one-line ModelError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    try:
        model = onnx.load(str(path))
    except (DecodeError, ValueError, OSError, RuntimeError) as exc:
        raise ModelError(f"{path}: not a readable ONNX model (truncated or another format?): {exc}") from exc
    if not model.graph.node:
        raise ModelError(f"{path}: the file holds no ONNX graph (truncated or another format?)")
    try:  # the weights as typed inputs: the checker serialises what it checks (VGG-11's 530 MB: 0.8-1.3 s)
        onnx.checker.check_model(without_weights(model))
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelError(f"{path}: fails onnx.checker: {first}") from exc
    return model


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    """Shape-infer, fold constants (Constant nodes, Cast/Identity of weights, values computed from static
    shapes; ``resize_by_scales``, ``fold_shape_values``, ``copy_batch_dims``) and name every node. Loop/If/Scan
    bodies are left as they are. The large float weights are never copied: the graph's constants read ``model``'s
    own tensors."""
    graph = _imported(*_protos_aside(model))
    try:
        graph.fold_constants(error_ok=True, recurse_subgraphs=False)
    except Exception:  # folding is an optimisation; unfoldable graphs are analysed as they are
        pass
    graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
    if resize_by_scales(graph) | fold_shape_values(graph) | copy_batch_dims(graph):
        try:
            graph.fold_constants(error_ok=True, recurse_subgraphs=False)
        except Exception:  # as above
            pass
        graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
    name_nodes(graph)
    return _reimported(graph)  # folding can drop shapes: inferred once more on the folded graph


class _Arrays(Mapping[str, np.ndarray]):
    """The values of constants by name, each read when a run asks for it (most imports run nothing)."""

    def __init__(self, constants: dict[str, gs.Constant]) -> None:
        self._constants = constants

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self._constants[name].values)

    def __iter__(self) -> Iterator[str]:
        return iter(self._constants)

    def __len__(self) -> int:
        return len(self._constants)


def inferred_graph(model: onnx.ModelProto, run: bool = False) -> gs.Graph:
    """``model``'s graph as it is (nothing folded), with the shapes ONNX inference gives, its large float weights read
    in place: what a pass that reads shapes needs before ``import_graph`` (a copy of the model for inference cost
    VGG-11's load 0.6 s). ``run``: the dims inference leaves unknown filled from onnxruntime runs as ``infer_shapes``
    fills them (a dynamic export's reshapes computed from ``Shape``), nothing run where none is unknown."""
    light, heavy = _protos_aside(model)
    return _imported(light, heavy) if run else _swapped(gs.import_onnx(onnx_infer(light)), heavy)


def _imported(light: onnx.ModelProto, heavy: dict[str, gs.Constant]) -> gs.Graph:
    """The graph of ``light`` with its shapes inferred (``infer_shapes``), each in-memory stub replaced by the constant
    of ``heavy`` of its name. An export, a shape inference and an import with the weights in copied them three times
    (VGG-11's 530 MB: about 1.4 s an import, three imports a ``compress``)."""
    return _swapped(gs.import_onnx(infer_shapes(light, _Arrays(heavy))), heavy)


def _swapped(graph: gs.Graph, heavy: dict[str, gs.Constant]) -> gs.Graph:
    """``graph`` with each in-memory stub replaced by the constant of ``heavy`` of its name, in place."""
    for node in graph.nodes:
        for i, x in enumerate(node.inputs):
            if isinstance(x, gs.Constant) and x.name in heavy:
                node.inputs[i] = heavy[x.name]
    return graph


def _protos_aside(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, gs.Constant]]:
    """``model`` with its large float initializers as in-memory stubs, and constants that read those initializers
    (not copied); initializers that are also graph inputs or outputs, or that a subgraph reads, stay."""
    graph = model.graph
    stay = {v.name for v in [*graph.input, *graph.output]} | _read_in_subgraphs(graph)
    heavy = {t.name: t for t in graph.initializer
             if t.name not in stay and weight_type(t.data_type) and held_bytes(t) >= EXPORT_BYTES}
    if not heavy:
        return model, {}
    return stubbed(model, heavy), {name: OnnxImporter.import_tensor(t) for name, t in heavy.items()}


def _reimported(graph: gs.Graph) -> gs.Graph:
    """``graph`` exported without its large float constants, shape-inferred and imported again with them; ``graph``
    is spent (its nodes read nothing after)."""
    large = large_constants(graph, EXPORT_BYTES)
    types = {name: _data_type(t) for name, t in large.items()}
    heavy = {name: t for name, t in large.items() if types[name] is not None and weight_type(types[name])}
    with constants_aside(heavy.values()):
        light = gs.export_onnx(graph)
    light.graph.initializer.extend(in_memory(name, types[name], t.shape, t._values.nbytes) for name, t in heavy.items())
    for node in graph.nodes:
        node.inputs.clear()  # the constants' readers: the new graph's nodes alone
    return _imported(light, heavy)


def _data_type(constant: gs.Constant) -> int | None:
    """The ONNX type of a dense constant's values (None: an array of a type ONNX has no number for)."""
    values = constant._values
    if isinstance(values, LazyValues):
        return values.tensor.data_type
    try:
        return onnx.helper.np_dtype_to_tensor_dtype(values.dtype)
    except (KeyError, TypeError, ValueError):
        return None


def _read_in_subgraphs(graph: onnx.GraphProto) -> set[str]:
    """The names the bodies of ``graph``'s nodes (Loop, If, Scan) read, at any depth."""
    names: set[str] = set()
    for node in graph.node:
        for attr in node.attribute:
            bodies = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for body in bodies:
                names |= {x for n in body.node for x in n.input} | _read_in_subgraphs(body)
    return names
