"""Pass: keep only the chosen channels of a group, in every producer, channel-wise op and consumer."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.consumers import bias_add
from onnxprune.analysis.groups import Group
from onnxprune.analysis.ops import SliceSite
from onnxprune.imitation.refit import expand_channels


def _sites(nodes: dict[str, gs.Node], group: Group) -> list[SliceSite]:
    """The group's slice sites plus producer biases written after the analysis found the group.

    A consumer re-fitted by ``refit_consumer`` may gain a bias (a Conv/Gemm bias input, or the Add
    after a MatMul) that the group's sites, computed on the original graph, do not list; when that
    node is later a producer of a pruned group, its bias must be sliced with its outputs.
    """
    sites = list(group.slices)
    known = {(s.node, s.input_index) for s in sites}
    for name in group.producers:
        node = nodes[name]
        if node.op in ("Conv", "ConvTranspose", "Gemm") and len(node.inputs) > 2 and (name, 2) not in known:
            bias = node.inputs[2]
            if isinstance(bias, gs.Constant) and np.asarray(bias.values).size > 1:
                sites.append(SliceSite(name, 2, np.asarray(bias.values).ndim - 1))
        add = bias_add(node)
        if add is not None and (add.name, 1) not in known:
            sites.append(SliceSite(add.name, 1, 0))
    return sites


def slice_channels(graph: gs.Graph, group: Group, keep: np.ndarray) -> gs.Graph:
    """Slice every constant indexed by the group's channels to ``keep`` (sorted) and fix shapes."""
    keep = np.sort(np.asarray(keep, dtype=np.int64))
    nodes = {n.name: n for n in graph.nodes}
    for site in _sites(nodes, group):
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
