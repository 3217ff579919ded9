"""MAC and parameter counts (Conv, ConvTranspose, Gemm, MatMul: the pruning papers' convention).

MACs are per sample (batch dimension excluded). ``MacModel`` also gives the exact count after
pruning for any choice of group widths, which the width allocation uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.graph import const_value, static_shape
from onnxprune.analysis.groups import Group
from onnxprune.errors import AnalysisError

MAC_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass(frozen=True)
class MacEntry:
    node: str
    op: str
    macs: int
    in_group: int | None
    out_group: int | None


def _prod(dims: list[int | None], where: str) -> int:
    if any(d is None for d in dims):
        raise AnalysisError(f"{where}: MACs need static shapes; export the model with a fixed input "
                            "size (only the batch dimension may be dynamic)")
    return int(np.prod(dims)) if dims else 1


def _inference_stop(node: gs.Node) -> gs.Node:
    """The upstream node where shape inference stopped: its output has no shape though its inputs do."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        parents = [t.inputs[0] for t in n.inputs if isinstance(t, gs.Variable) and t.shape is None and t.inputs]
        if not parents:
            return n
        stack.extend(parents)
    return node


def node_macs(node: gs.Node) -> int:
    """MACs of one node for a single sample."""
    out = static_shape(node.outputs[0])
    inp = static_shape(node.inputs[0])
    where = f"{node.op} {node.name}"
    if out is None or inp is None:
        stop = _inference_stop(node)
        if stop is not node:
            domain = f" (domain {stop.domain})" if getattr(stop, "domain", None) else ""
            raise AnalysisError(f"{where}: unknown shapes: shape inference stops at {stop.op}{domain} {stop.name}; "
                                "declare its output shape as value_info in the model")
        raise AnalysisError(f"{where}: unknown shapes; export the model with a fixed input size")
    weight = const_value(node.inputs[1])
    if node.op == "Conv":
        w_shape = weight.shape if weight is not None else static_shape(node.inputs[1])
        return _prod(out[1:], where) * _prod(list(w_shape[1:]), where)
    if node.op == "ConvTranspose":
        w_shape = weight.shape if weight is not None else static_shape(node.inputs[1])
        return _prod(inp[1:], where) * _prod(list(w_shape[1:]), where)
    # Gemm / MatMul: every output entry is a dot product over the reduced dimension.
    k = inp[0] if node.op == "Gemm" and int(node.attrs.get("transA", 0)) else inp[-1]
    return _prod(out[1:], where) * _prod([k], where)


def count_params(graph: gs.Graph) -> int:
    """Number of floating-point constant elements used by nodes (weights, biases, BN statistics)."""
    seen: set[str] = set()
    total = 0
    for node in graph.nodes:
        for tensor in node.inputs:
            if isinstance(tensor, gs.Constant) and tensor.name not in seen:
                seen.add(tensor.name)
                values = np.asarray(tensor.values)
                if np.issubdtype(values.dtype, np.floating):
                    total += int(values.size)
    return total


class MacModel:
    """Per-node MACs and which group's width scales each node's input and output channels."""

    def __init__(self, graph: gs.Graph, groups: list[Group]) -> None:
        member = {name: g.id for g in groups for name in g.tensors}
        self.channels = {g.id: g.channels for g in groups}
        self.entries = [
            MacEntry(
                node.name,
                node.op,
                node_macs(node),
                member.get(node.inputs[0].name),
                member.get(node.outputs[0].name),
            )
            for node in graph.nodes
            if node.op in MAC_OPS
        ]

    @property
    def total(self) -> int:
        return sum(e.macs for e in self.entries)

    def macs(self, widths: dict[int, int]) -> float:
        """Exact MACs when group ``g`` keeps ``widths[g]`` channels (others unchanged)."""
        total = 0.0
        for e in self.entries:
            scale = 1.0
            for gid in {e.in_group, e.out_group} - {None}:
                if gid in widths:
                    scale *= widths[gid] / self.channels[gid]
            total += e.macs * scale
        return total
