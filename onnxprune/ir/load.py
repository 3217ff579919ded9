"""Loading an ONNX file into a normalised graph-surgeon graph that the analysis can read."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError

from onnxprune.errors import ModelError
from onnxprune.ir.graph import export_model, name_nodes
from onnxprune.ir.shapes import copy_batch_dims, fold_shape_values, resize_by_scales, infer_shapes


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
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelError(f"{path}: fails onnx.checker: {first}") from exc
    return model


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    """Shape-infer, fold constants (Constant nodes, Cast/Identity of weights, values computed from static
    shapes; ``resize_by_scales``, ``fold_shape_values``, ``copy_batch_dims``) and name every node. Loop/If/Scan
    bodies are left as they are."""
    graph = gs.import_onnx(infer_shapes(model))
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
    # Folding can drop shapes; re-infer once on the folded graph.
    graph = gs.import_onnx(infer_shapes(export_model(graph)))
    return graph
