"""Pass: keep only the chosen channels of a group, in every producer, channel-wise op and consumer."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.groups import Group
from onnxprune.imitation.refit import expand_channels


def slice_channels(graph: gs.Graph, group: Group, keep: np.ndarray) -> gs.Graph:
    """Slice every constant indexed by the group's channels to ``keep`` (sorted) and fix shapes."""
    keep = np.sort(np.asarray(keep, dtype=np.int64))
    nodes = {n.name: n for n in graph.nodes}
    for site in group.slices:
        node = nodes[site.node]
        const = node.inputs[site.input_index]
        values = np.take(np.asarray(const.values), expand_channels(keep, site.repeat), axis=site.axis)
        node.inputs[site.input_index] = gs.Constant(f"{const.name}.keep{group.id}", np.ascontiguousarray(values))
    for site in group.attrs:
        nodes[site.node].attrs[site.attr] = int(len(keep))
    tensors = graph.tensors()
    for name, (axis, repeat) in group.tensors.items():
        tensor = tensors[name]
        if tensor.shape is not None and axis < len(tensor.shape):
            shape = list(tensor.shape)
            shape[axis] = int(len(keep) * repeat)
            tensor.shape = shape
    return graph.cleanup().toposort()
