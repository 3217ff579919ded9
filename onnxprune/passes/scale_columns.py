"""Pass: multiply each consumer's input columns of a group by a per-channel factor.

This is the paper's "fold the simplex weights into the next layer" (factor N·a_i) and the
per-channel least-squares rescaling.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.groups import Group


def scale_columns(graph: gs.Graph, group: Group, scale: np.ndarray) -> gs.Graph:
    """Multiply the group's input columns of every consumer weight by ``scale``, one factor per channel the
    group has NOW (after any slicing).

    In place: ``graph`` is modified (each scaled weight becomes a new constant on its node, then cleanup and
    toposort); returns the same graph, for chaining. Copy it first (``graph.copy()``) to keep the original."""
    consumers = {c.node for c in group.consumers}
    nodes = {n.name: n for n in graph.nodes}
    tensors = graph.tensors()
    for site in group.slices:
        if site.node not in consumers or site.input_index != 1:
            continue
        node = nodes[site.node]
        const = node.inputs[1]
        values = np.asarray(const.values)
        factor = np.ones(values.shape[site.axis])
        index = group.entries(tensors, site.tensor, site.offset, site.repeat) if site.tensor else np.arange(factor.size)
        factor[index] = np.repeat(np.asarray(scale, dtype=np.float64), site.repeat)
        shape = [1] * values.ndim
        shape[site.axis] = factor.size
        scaled = (values * factor.reshape(shape)).astype(values.dtype)
        node.inputs[1] = gs.Constant(f"{const.name}.scaled{group.id}", scaled)
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
