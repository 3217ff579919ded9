"""A model's analysis: its graph as analysed, its channel groups, MACs and parameters, its removable blocks."""

from __future__ import annotations

from dataclasses import dataclass

import onnx
import onnx_graphsurgeon as gs

from onnxprune.analysis.blocks import Block, find_blocks
from onnxprune.ir.load import import_graph
from onnxprune.analysis.groups import Group, find_groups
from onnxprune.analysis.macs import MacModel, count_params, uncounted


@dataclass
class Analysis:
    graph: gs.Graph
    groups: list[Group]
    macs: MacModel
    params: int
    blocks: dict[int, Block]  # the removable residual blocks, by their hidden group's id
    uncounted: list[str]  # control-flow nodes whose subgraphs' MACs are not counted (``macs.uncounted``)
    preflight: dict | None = None  # what the pre-flight run found (``onnxprune.pipeline.preflight``), where it ran

    @property
    def task(self) -> str | None:
        """The task the pre-flight read from the outputs (``onnxprune.tasks``), where it ran."""
        return None if self.preflight is None else self.preflight["task"]

    @property
    def prunable(self) -> list[Group]:
        return [g for g in self.groups if g.prunable]

    def prunable_share(self) -> float:
        """Share of MACs whose input or output channels belong to a prunable group."""
        ids = {g.id for g in self.prunable}
        touched = sum(e.macs for e in self.macs.entries if e.groups & ids)
        return touched / max(self.macs.total, 1)

    def to_dict(self) -> dict:
        return {
            "macs": self.macs.total,
            "params": self.params,
            "prunable_mac_share": self.prunable_share(),
            "macs_not_counted_in": self.uncounted,
            "macs_unknown_shapes": self.macs.unknown,
            "preflight": self.preflight,
            "task": self.task,
            "groups": [{**g.to_dict(), "removable_block": g.id in self.blocks} for g in self.groups],
        }


def analyze(model: onnx.ModelProto) -> Analysis:
    graph = import_graph(model)
    groups = find_groups(graph)
    return Analysis(graph, groups, MacModel(graph, groups), count_params(graph), find_blocks(graph, groups),
                    uncounted(graph))
