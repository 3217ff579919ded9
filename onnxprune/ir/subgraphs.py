"""Control-flow subgraphs (Loop, If and Scan bodies) as graph-surgeon holds them. The tool prunes around the
nodes that hold them and leaves the bodies as they are; these helpers find what the bodies contain and read."""

from __future__ import annotations

import onnx_graphsurgeon as gs


def bodies(node: gs.Node) -> list[gs.Graph]:
    """The subgraphs ``node`` holds as attributes."""
    return [v for v in node.attrs.values() if isinstance(v, gs.Graph)]


def nodes_within(graph: gs.Graph) -> list[gs.Node]:
    """The nodes of ``graph`` and of every subgraph in it, at any depth."""
    out = []
    for node in graph.nodes:
        out.append(node)
        for body in bodies(node):
            out.extend(nodes_within(body))
    return out


def owners(graph: gs.Graph) -> dict[int, gs.Node]:
    """``id`` of every node inside a subgraph of ``graph`` (at any depth) -> the node of ``graph`` that holds it."""
    return {id(inner): node for node in graph.nodes for body in bodies(node) for inner in nodes_within(body)}


def outer_reads(node: gs.Node) -> list[gs.Tensor]:
    """The tensors of the enclosing graph that ``node``'s subgraphs read by name (not through its inputs)."""
    inner = [n for body in bodies(node) for n in nodes_within(body)]
    local = {t.name for n in inner for t in n.outputs} | {t.name for body in bodies(node) for t in body.inputs}
    local |= {t.name for body in bodies(node) for t in body.tensors().values() if isinstance(t, gs.Constant)}
    seen: dict[str, gs.Tensor] = {}
    for n in inner:
        for t in n.inputs:
            if t.name and t.name not in local:
                seen.setdefault(t.name, t)
    return list(seen.values())
