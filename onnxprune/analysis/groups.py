"""Channel groups: the producers, channel-wise ops and consumers that share one set of channels."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from onnxprune.analysis.graph import static_shape
from onnxprune.analysis.ops import (
    AttrSite,
    Blocked,
    Channelwise,
    Consumer,
    Port,
    Producer,
    SliceSite,
    role_of,
)

PRODUCER_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


@dataclass(frozen=True)
class ConsumerUse:
    """A channel-mixing node reading the group's channels from ``tensor`` (``repeat`` columns each)."""

    node: str
    kind: str
    tensor: str
    repeat: int


@dataclass
class Group:
    """One channel space. Pruning keeps the same channel subset in every member tensor."""

    id: int
    channels: int
    tensors: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (axis, repeat)
    producers: list[str] = field(default_factory=list)
    consumers: list[ConsumerUse] = field(default_factory=list)
    slices: list[SliceSite] = field(default_factory=list)
    attrs: list[AttrSite] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.producers[0] if self.producers else f"group{self.id}"

    @property
    def coupled(self) -> bool:
        return len(self.producers) > 1

    @property
    def prunable(self) -> bool:
        return not self.blockers and bool(self.producers) and bool(self.consumers) and self.channels > 1

    @property
    def reason(self) -> str | None:
        if self.blockers:
            return self.blockers[0]
        if not self.consumers:
            return "no channel-mixing consumer"
        if self.channels <= 1:
            return "a single channel"
        return None

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "channels": self.channels,
            "producers": self.producers,
            "consumers": [c.node for c in self.consumers],
            "coupled": self.coupled,
            "prunable": self.prunable,
            "reason": self.reason,
        }


def _producer_axis(node: gs.Node) -> int | None:
    if node.op == "MatMul":
        shape = static_shape(node.outputs[0])
        return None if shape is None else len(shape) - 1
    return 1


def _port_tensors(node: gs.Node, port: Port) -> gs.Tensor:
    return node.inputs[port[1]] if port[0] == "in" else node.outputs[port[1]]


class _Search:
    """Breadth-first search of one channel space from a producer's output."""

    def __init__(self, graph: gs.Graph, group: Group) -> None:
        self.group = group
        self.inputs = {t.name for t in graph.inputs}
        self.outputs = {t.name for t in graph.outputs}
        self.visited: set[tuple[str, Port]] = set()
        self.queue: deque[tuple[gs.Tensor, int, int]] = deque()

    def add_tensor(self, tensor: gs.Tensor, axis: int, repeat: int) -> None:
        known = self.group.tensors.get(tensor.name)
        if known is not None:
            if known != (axis, repeat):
                self.group.blockers.append(f"tensor {tensor.name} carries the channels on two axes")
            return
        self.group.tensors[tensor.name] = (axis, repeat)
        if tensor.name in self.outputs:
            self.group.blockers.append(f"channels reach the graph output {tensor.name}")
        if tensor.name in self.inputs:
            self.group.blockers.append(f"channels come from the graph input {tensor.name}")
        self.queue.append((tensor, axis, repeat))

    def visit(self, node: gs.Node, port: Port, axis: int, repeat: int) -> None:
        if (node.name, port) in self.visited:
            return
        self.visited.add((node.name, port))
        role = role_of(node, port, axis, repeat)
        tensor = _port_tensors(node, port)
        if isinstance(role, Blocked):
            self.group.blockers.append(role.reason)
        elif isinstance(role, Producer):
            self.group.producers.append(node.name)
            self.group.slices.extend(role.slices)
        elif isinstance(role, Consumer):
            self.group.consumers.append(ConsumerUse(node.name, role.kind, tensor.name, repeat))
            self.group.slices.extend(role.slices)
        elif isinstance(role, Channelwise):
            self.group.slices.extend(s for s in role.slices if s not in self.group.slices)
            self.group.attrs.extend(a for a in role.attrs if a not in self.group.attrs)
            for other, (o_axis, o_repeat) in role.ports.items():
                self.visited.add((node.name, other))
                self.add_tensor(_port_tensors(node, other), o_axis, o_repeat)

    def run(self) -> None:
        while self.queue:
            tensor, axis, repeat = self.queue.popleft()
            for node in list(tensor.inputs):
                self.visit(node, ("out", node.outputs.index(tensor)), axis, repeat)
            for node in list(tensor.outputs):
                for k, inp in enumerate(node.inputs):
                    if inp is tensor:
                        self.visit(node, ("in", k), axis, repeat)


def find_groups(graph: gs.Graph) -> list[Group]:
    """Every channel space that starts at a Conv/ConvTranspose/Gemm/MatMul output, in graph order."""
    groups: list[Group] = []
    assigned: set[str] = set()
    tensor_map = graph.tensors()
    for node in graph.nodes:
        if node.op not in PRODUCER_OPS or not node.outputs or node.outputs[0].name in assigned:
            continue
        axis = _producer_axis(node)
        out = node.outputs[0]
        shape = static_shape(out)
        if axis is None or shape is None or shape[axis] is None:
            continue
        role = role_of(node, ("out", 0), axis, 1)
        if isinstance(role, Channelwise):
            continue  # depthwise conv: part of its input's space
        group = Group(id=len(groups), channels=int(shape[axis]))
        search = _Search(graph, group)
        search.visited.add((node.name, ("out", 0)))
        if isinstance(role, Blocked):
            group.blockers.append(role.reason)
            group.producers.append(node.name)
            group.tensors[out.name] = (axis, 1)
        else:
            group.producers.append(node.name)
            group.slices.extend(role.slices)
            search.add_tensor(out, axis, 1)
            search.run()
        for name, (t_axis, repeat) in group.tensors.items():
            dims = static_shape(tensor_map[name])
            if dims is not None and dims[t_axis] not in (None, group.channels * repeat):
                group.blockers.append(f"tensor {name} has {dims[t_axis]} entries on the channel axis, "
                                      f"expected {group.channels}×{repeat}")
        assigned.update(group.tensors)
        groups.append(group)
    return groups
