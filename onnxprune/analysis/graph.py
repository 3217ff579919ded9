"""Loading an ONNX file into a normalised graph-surgeon graph that the analysis can read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from google.protobuf.message import DecodeError

from onnxprune.errors import ModelError


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


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """ONNX shape inference with data propagation (shapes of Reshape targets etc.)."""
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # inference is best effort: analysis reports missing shapes itself
        return model


def import_graph(model: onnx.ModelProto) -> gs.Graph:
    """Shape-infer, fold constants (Constant nodes, Cast/Identity of weights) and name every node."""
    graph = gs.import_onnx(infer_shapes(model))
    try:
        graph.fold_constants(error_ok=True)
    except Exception:  # folding is an optimisation; unfoldable graphs are analysed as they are
        pass
    graph.cleanup().toposort()
    name_nodes(graph)
    # Folding can drop shapes; re-infer once on the folded graph.
    graph = gs.import_onnx(infer_shapes(gs.export_onnx(graph)))
    return graph


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


def static_shape(tensor: gs.Tensor) -> list[int | None] | None:
    """Tensor shape with dynamic dims as None, or None when the rank is unknown."""
    if tensor.shape is None:
        return None
    return [d if isinstance(d, (int, np.integer)) and d >= 0 else None for d in tensor.shape]
