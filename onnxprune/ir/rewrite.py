"""Rewrites applied to a model as it is loaded, only where they find something to rewrite."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import onnx
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import export_model, read_instead, restore_subgraphs
from onnxprune.ir.load import inferred_graph
from onnxprune.ir.subgraphs import outer_reads

T = TypeVar("T")
Rewrite = tuple[Callable[[gs.Graph], bool], Callable[[gs.Graph], gs.Graph]]  # (finds something, the pass)


def rewritten(model: onnx.ModelProto, rewrites: Sequence[Rewrite], run: bool = False) -> onnx.ModelProto:
    """``model`` through each pass of ``rewrites`` whose finder sees something for it in the graph (shapes inferred
    once, with ``run`` the dims ONNX inference leaves unknown from onnxruntime runs, for passes that read shapes; the
    finders asked on the graph as given), in order; ``model`` itself where none does (no graph-surgeon round trip for
    the models that need none). The ir version, opsets and subgraph bodies stay the model's."""
    try:
        graph = constants_read_directly(inferred_graph(model, run))
    except Exception:  # noqa: BLE001 - inference is best effort; a model it rejects is left as it is
        return model
    due = [rewrite for finds, rewrite in rewrites if finds(graph)]
    if not due:
        return model
    for rewrite in due:
        graph = rewrite(graph)
    out = export_model(graph)
    out.ir_version = model.ir_version
    del out.opset_import[:]
    out.opset_import.extend(model.opset_import)
    return restore_subgraphs(out, model)


def constants_read_directly(graph: gs.Graph) -> gs.Graph:
    """``graph`` with every ``Identity`` of a constant bypassed, its readers reading the constant (torch.onnx writes one
    for each initializer it deduplicates: equal BatchNorm scales, a weight used twice), so that passes see weights as
    constants. In place; returns the same graph."""
    outputs = {t.name for t in graph.outputs} | {t.name for node in graph.nodes for t in outer_reads(node)}
    for node in graph.nodes:
        if node.op == "Identity" and isinstance(node.inputs[0], gs.Constant) and node.outputs[0].name not in outputs:
            read_instead(node.outputs[0], node.inputs[0])
    return graph.cleanup(recurse_subgraphs=False)


def only_reader(tensor: gs.Tensor, outputs: set[str]) -> gs.Node | None:
    """The one node reading ``tensor`` where that is all that reads it (none of the graph ``outputs``), else None: a
    tensor a pass may rewrite together with its reader."""
    return tensor.outputs[0] if len(tensor.outputs) == 1 and tensor.name not in outputs else None


def matches(graph: gs.Graph, op: str, match: Callable[[gs.Node, set[str]], T | None]) -> Iterator[tuple[gs.Node, T]]:
    """Each node of type ``op`` in ``graph`` (listed before any is rewritten) with what ``match`` finds at it, given
    the graph's output names (a tensor a pass must keep); nodes where it finds nothing are skipped."""
    outputs = {t.name for t in graph.outputs}
    for node in [n for n in graph.nodes if n.op == op]:
        found = match(node, outputs)
        if found is not None:
            yield node, found
