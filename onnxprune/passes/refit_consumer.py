"""Pass: replace a consumer's weights and bias by re-fitted ones (least-squares reconstruction)."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxprune.analysis import consumers


def refit_consumer(graph: gs.Graph, node_name: str, linear: consumers.Linear) -> gs.Graph:
    node = next(n for n in graph.nodes if n.name == node_name)
    consumers.write(graph, node, linear)
    return graph.cleanup().toposort()
