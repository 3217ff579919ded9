"""Pass: keep only the chosen channels of a group, in every producer, channel-wise op and consumer."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.consumers import bias_add
from onnxprune.analysis.groups import Group, keep_index, kept_entries
from onnxprune.ops.registry import lookup
from onnxprune.ops.roles import SliceSite


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
        weight = next((s for s in sites if s.node == name and s.input_index == 1), None)
        where = {} if weight is None else {"tensor": weight.tensor, "offset": weight.offset}
        mixing = lookup(node.op).mixing
        slot = None if mixing is None else mixing.bias_input
        if slot is not None and len(node.inputs) > slot and (name, slot) not in known:
            bias = node.inputs[slot]
            if isinstance(bias, gs.Constant) and np.asarray(bias.values).size > 1:
                sites.append(SliceSite(name, slot, np.asarray(bias.values).ndim - 1, **where))
        add = bias_add(node)
        if add is not None and (add.name, 1) not in known:
            sites.append(SliceSite(add.name, 1, 0, **where))
    return sites


def slice_channels(graph: gs.Graph, group: Group, keep: np.ndarray) -> gs.Graph:
    """Slice every constant indexed by the group's channels to ``keep`` (sorted) and fix shapes.

    Mutates ``graph`` in place and returns the same graph (cleaned up and sorted), onnx-graphsurgeon's habit.
    """
    keep = np.sort(np.asarray(keep, dtype=np.int64))
    nodes = {n.name: n for n in graph.nodes}
    tensors = graph.tensors()
    width = group.width(tensors)
    # Every index is computed on the layout before this slicing, then applied; a constant that holds
    # the group's channels twice (a consumer of a Concat of them with themselves) is sliced once.
    starts: dict[tuple[str, int, int, int], list[int]] = {}
    for site in _sites(nodes, group):
        start = group.layout.current(tensors, site.tensor, site.offset) if site.tensor else 0
        starts.setdefault((site.node, site.input_index, site.axis, site.repeat), []).append(start)
    plans = []
    for (name, i, axis, repeat), at in starts.items():
        size = np.asarray(nodes[name].inputs[i].values).shape[axis]
        plans.append((nodes[name], i, axis, keep_index(size, at, width, repeat, keep)))
    entries = kept_entries(graph, group, keep)
    # a constant read by several nodes (folded weights an exporter shares) is sliced once per distinct index
    sliced: dict[tuple[int, int, bytes], gs.Constant] = {}
    names: set[str] = set()
    for node, i, axis, index in plans:
        const = node.inputs[i]
        key = (id(const), axis, index.tobytes())
        if key not in sliced:
            name = f"{const.name}.keep{group.id}"
            name = next(n for k in range(len(names) + 1) if (n := name + (f".{k}" if k else "")) not in names)
            names.add(name)
            values = np.take(np.asarray(const.values), index, axis=axis)
            sliced[key] = gs.Constant(name, np.ascontiguousarray(values))
        node.inputs[i] = sliced[key]
    for site in group.attrs:
        nodes[site.node].attrs[site.attr] = int(nodes[site.node].attrs[site.attr]) - site.per * (width - len(keep))
    for name, index in entries.items():
        axis = group.tensors[name][0]
        shape = list(tensors[name].shape)
        shape[axis] = int(len(index))
        tensors[name].shape = shape
    for site in group.resizes:
        node = nodes[site.node]
        bounds = [group.layout.current(tensors, site.tensor, b) for b in site.bounds]
        lookup(node.op).resize(node, site, bounds, group.id, graph)
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
