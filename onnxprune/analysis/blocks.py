"""Residual blocks that can be removed whole: a group whose channels live only inside one block.

A block ``y = x + Conv(f(Producer(x)))`` where the producer reads the block's input ``x``, ``f`` are the group's
channel-wise ops and the Conv is the group's only consumer, feeding the residual ``Add`` alone. Pruning its
group to width 0 leaves the Conv's bias: the block becomes ``x + b`` (``passes.remove_block``). MobileNetV2's
inverted residuals with a shortcut, ResNet's basic blocks and YOLO's bottlenecks have this shape; a bottleneck
with two hidden groups in series (ResNet-50) does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_graphsurgeon as gs

from onnxprune.ir.graph import static_shape
from onnxprune.analysis.groups import Group


@dataclass(frozen=True)
class Block:
    """A removable block: its hidden group, the consumer Conv that closes it and the residual Add."""

    group: int
    consumer: str
    add: str


def find_blocks(graph: gs.Graph, groups: list[Group]) -> dict[int, Block]:
    """The removable blocks, by the id of their hidden group."""
    nodes = {n.name: n for n in graph.nodes}
    tensors = graph.tensors()
    outputs = {t.name for t in graph.outputs}
    blocks = {}
    for g in groups:
        if not g.prunable or g.partial or len(g.producers) != 1 or len(g.consumers) != 1:
            continue
        producer, consumer = nodes[g.producers[0]], nodes[g.consumers[0].node]
        if consumer.op != "Conv" or int(consumer.attrs.get("group", 1)) != 1 or not producer.inputs:
            continue
        y = consumer.outputs[0]
        if y.name in outputs or len(y.outputs) != 1 or y.outputs[0].op != "Add" or len(y.outputs[0].inputs) != 2:
            continue
        add = y.outputs[0]
        shortcut = next(t for t in add.inputs if t is not y) if add.inputs.count(y) == 1 else None
        if shortcut is None or shortcut is not producer.inputs[0]:
            continue
        shape = static_shape(y)
        if shape is None or None in shape[1:] or static_shape(shortcut) != shape:
            continue
        if _closed(g, tensors, consumer):
            blocks[g.id] = Block(g.id, consumer.name, add.name)
    return blocks


def _closed(group: Group, tensors: dict[str, gs.Tensor], consumer: gs.Node) -> bool:
    """Whether the group's tensors are read only by the nodes that write them and by ``consumer``, and those
    write nothing else (removing the block removes exactly these nodes)."""
    members = [tensors[name] for name in group.tensors]
    writers = {n.name: n for t in members for n in t.inputs}
    if any(out.name not in group.tensors for n in writers.values() for out in n.outputs):
        return False
    inside = {*writers, consumer.name}
    return all(reader.name in inside for t in members for reader in t.outputs)
