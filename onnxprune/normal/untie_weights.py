"""Pass: a float weight read by several nodes gets one copy for each reader.

Exporters write one initializer for equal ones: torch.onnx deduplicates a transformer's norm weights, norm biases and
layer scales, equal at initialisation (EdgeNeXt-XXS: 14 of them, each read by two or three blocks). Trained as one
weight, blocks that learnt apart would be tied again; and ``recover`` trains a window or the head on inputs cached
before it, while the same weight also acts there, so its written model would not be the one it trained. Untied, each
reader ``r`` of weight ``w`` reads its own ``w.r`` (the same names in a teacher and in the student pruned from it).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_graphsurgeon as gs


def untie_weights(graph: gs.Graph) -> gs.Graph:
    """Give every reader of a float constant that several nodes read its own copy, named ``<constant>.<reader>``
    (``.<input index>`` added where one node reads it twice).

    In place: ``graph`` is modified, then cleaned up and sorted; returns the same graph."""
    shared = _shared(graph)
    for node in graph.nodes:
        twice = Counter(t.name for t in node.inputs if t.name in shared)
        for i, t in enumerate(node.inputs):
            if t.name in shared:
                name = f"{t.name}.{node.name}" + (f".{i}" if twice[t.name] > 1 else "")
                node.inputs[i] = gs.Constant(name, t.values)
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def has_shared_weights(graph: gs.Graph) -> bool:
    """Whether ``untie_weights`` finds a float constant that several nodes read in ``graph``."""
    return bool(_shared(graph))


def _shared(graph: gs.Graph) -> set[str]:
    reads = Counter(t.name for node in graph.nodes for t in node.inputs
                    if isinstance(t, gs.Constant) and np.issubdtype(np.dtype(t.dtype), np.floating))
    return {name for name, count in reads.items() if count > 1}
