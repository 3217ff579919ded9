"""Pass: replace a consumer's weights and bias by re-fitted ones (least-squares reconstruction)."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxprune.analysis import consumers
from onnxprune.analysis.groups import ConsumerUse, Group


def refit_consumer(graph: gs.Graph, node_name: str, linear: consumers.Linear, group: Group | None = None,
                   use: ConsumerUse | None = None) -> gs.Graph:
    """Write ``linear`` as the node's weights; with ``group``, it holds only that group's columns
    (``consumers.group_view``) and the columns of other groups in the same input stay as they are.

    In place: ``graph`` is modified (the node's weight and bias, then cleanup and toposort); returns the
    same graph, for chaining. Copy it first (``graph.copy()``) to keep the original."""
    node = next(n for n in graph.nodes if n.name == node_name)
    if group is not None and use is not None:
        view = consumers.group_view(graph, node, group, use)
        full = consumers.matrix(node)
        full.weight[:, view.cols] = linear.weight
        linear = consumers.Linear(full.weight, linear.bias, full.k)
    consumers.write(graph, node, linear)
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
