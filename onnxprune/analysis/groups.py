"""Channel groups: the producers, channel-wise ops and consumers that share one set of channels.

A group may hold only a range of a tensor's channel axis: one input of a channel-axis Concat, one
piece of a Split or Slice (a producer whose output is split is one group per piece). Its offsets
there are recorded in the original graph; as other groups in the same tensor are pruned they move,
so ``Layout`` finds the current ones from the graph being pruned (each group's width is read from a
tensor that holds exactly its channels, its witness).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import static_shape
from onnxprune.analysis.ops import role_of
from onnxprune.ops.registry import Having, lookup
from onnxprune.ops.roles import (
    AttrSite,
    Blocked,
    Channelwise,
    Consumer,
    Cut,
    Port,
    Producer,
    Regroup,
    ResizeSite,
    SliceSite,
)
from onnxprune.ir.subgraphs import owners

PRODUCER_OPS = Having("mixing")  # the op types that create channels (``op in PRODUCER_OPS``)
Witness = tuple[str, int, int]  # (tensor, axis, repeat) holding exactly a group's channels


@dataclass(frozen=True)
class ConsumerUse:
    """A channel-mixing node reading the group's channels from ``tensor`` (``repeat`` columns each)."""

    node: str
    kind: str
    tensor: str
    repeat: int


@dataclass
class Layout:
    """Which groups hold which channel ranges of each tensor (original offsets, in channels)."""

    segments: dict[str, list[tuple[int, int, Witness | None]]] = field(default_factory=dict)

    def current(self, tensors: dict[str, gs.Tensor], name: str, offset: int, unpruned: Witness | None = None) -> int:
        """Where original channel position ``offset`` of tensor ``name`` is in the graph of ``tensors``
        (with the group of witness ``unpruned`` counted at its original width)."""
        shift = 0
        for start, length, witness in self.segments.get(name, []):
            if witness is not None and witness != unpruned and start + length <= offset:
                shift += length - _width(tensors, witness, length)
        return offset - shift


def _width(tensors: dict[str, gs.Tensor], witness: Witness, default: int) -> int:
    name, axis, repeat = witness
    shape = tensors[name].shape if name in tensors else None
    dim = shape[axis] if shape is not None and axis < len(shape) else None
    return int(dim) // repeat if isinstance(dim, (int, np.integer)) else default


@dataclass
class Group:
    """One channel space. Pruning keeps the same channel subset in every member tensor."""

    id: int
    channels: int
    tensors: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (axis, repeat)
    offsets: dict[str, list[int]] = field(default_factory=dict)  # name -> original offsets of the range(s)
    producers: list[str] = field(default_factory=list)
    consumers: list[ConsumerUse] = field(default_factory=list)
    slices: list[SliceSite] = field(default_factory=list)
    attrs: list[AttrSite] = field(default_factory=list)
    resizes: list[ResizeSite] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list)
    gates: list[str] = field(default_factory=list)  # convs that read the channels and write a gate of them
    witness: Witness | None = None
    partial: bool = False  # some member tensor holds other channels too, or these channels twice
    piece: str = ""  # "[a:b]" when the group is a range of its first producer's output channels
    unit: int = 1  # entries of its first producer's output a channel is: a conv group's channels (``Regroup``)
    units: str = "conv groups"  # what such a channel is, in the user's words (``Regroup.what``)
    layout: Layout = field(default_factory=Layout)

    @property
    def name(self) -> str:
        return self.producers[0] + self.piece if self.producers else f"group{self.id}"

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

    def width(self, tensors: dict[str, gs.Tensor]) -> int:
        """The group's channel count in the graph of ``tensors`` (after any pruning of it)."""
        return self.channels if self.witness is None else _width(tensors, self.witness, self.channels)

    def starts(self, tensors: dict[str, gs.Tensor], name: str, unpruned: bool = False) -> list[int]:
        """Current offsets (in channels) of the group's range(s) in tensor ``name`` (``unpruned``: as
        they were before this group was sliced)."""
        own = self.witness if unpruned else None
        return [self.layout.current(tensors, name, o, own) for o in self.offsets.get(name, [0])]

    def entries(self, tensors: dict[str, gs.Tensor], name: str, offset: int, repeat: int) -> np.ndarray:
        """Current indices of the group's entries (``repeat`` per channel) at one original ``offset``."""
        start = self.layout.current(tensors, name, offset)
        return np.arange(start * repeat, (start + self.width(tensors)) * repeat)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "name": self.name,
            "channels": self.channels,
            "unit": self.unit,
            "units": self.units,
            "producers": self.producers,
            "consumers": [c.node for c in self.consumers],
            "coupled": self.coupled,
            "prunable": self.prunable,
            "reason": self.reason,
        }


def keep_index(size: int, starts: list[int], width: int, repeat: int, keep: np.ndarray) -> np.ndarray:
    """Indices along an axis of ``size`` entries that survive when the group (``width`` channels of
    ``repeat`` entries at each channel offset in ``starts``) keeps channels ``keep``."""
    mask = np.ones(size, dtype=bool)
    keep = np.sort(np.asarray(keep, dtype=np.int64))
    for start in starts:
        mask[start * repeat : (start + width) * repeat] = False
        mask[((keep + start)[:, None] * repeat + np.arange(repeat)).ravel()] = True
    return np.flatnonzero(mask)


def kept_entries(graph: gs.Graph, group: Group, keep: np.ndarray,
                 sizes: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """For every member tensor: the indices along its channel axis that survive slicing ``keep``.

    Without ``sizes``, on ``graph`` before the slicing (tensors of unknown size are left out); with
    ``sizes`` (each tensor's size before the slicing), on ``graph`` after slicing the group once."""
    tensors = graph.tensors()
    width = group.channels if sizes is not None else group.width(tensors)
    out = {}
    for name, (axis, repeat) in group.tensors.items():
        shape = tensors[name].shape if name in tensors else None
        size = sizes.get(name) if sizes is not None else (
            shape[axis] if shape is not None and axis < len(shape) else None)
        if isinstance(size, (int, np.integer)):
            starts = group.starts(tensors, name, unpruned=sizes is not None)
            out[name] = keep_index(int(size), starts, width, repeat, keep)
    return out


def _port_tensors(node: gs.Node, port: Port) -> gs.Tensor:
    return node.inputs[port[1]] if port[0] == "in" else node.outputs[port[1]]


class _CutFound(Exception):
    def __init__(self, at: list[int]) -> None:
        super().__init__(at)
        self.at = at


class _RegroupFound(Exception):
    def __init__(self, role: Regroup) -> None:
        super().__init__(role.unit)
        self.role = role


class _Search:
    """Breadth-first search of one channel space from a producer's output range."""

    def __init__(self, graph: gs.Graph, group: Group, regroup: bool = True) -> None:
        self.group, self.regroup = group, regroup
        self.inputs = {t.name for t in graph.inputs}
        self.outputs = {t.name for t in graph.outputs}
        self.visited: set[tuple[str, Port, int]] = set()
        self.owners = owners(graph)
        self.queue: deque[tuple[gs.Tensor, int, int, int]] = deque()

    def add_tensor(self, tensor: gs.Tensor, axis: int, repeat: int, offset: int) -> None:
        known = self.group.tensors.get(tensor.name)
        if known is not None:
            if known != (axis, repeat):
                self.group.blockers.append(f"tensor {tensor.name} carries the channels on two axes")
                return
            if offset in self.group.offsets[tensor.name]:
                return
            self.group.offsets[tensor.name].append(offset)
        else:
            self.group.tensors[tensor.name] = (axis, repeat)
            self.group.offsets[tensor.name] = [offset]
        if tensor.name in self.outputs:
            self.group.blockers.append(f"channels reach the graph output {tensor.name}, which keeps its width")
        if tensor.name in self.inputs:
            self.group.blockers.append(f"channels come from the graph input {tensor.name}, which keeps its width")
        self.queue.append((tensor, axis, repeat, offset))

    def visit(self, node: gs.Node, port: Port, axis: int, repeat: int, offset: int) -> None:
        if (node.name, port, offset) in self.visited:
            return
        self.visited.add((node.name, port, offset))
        role = role_of(node, port, axis, repeat, (offset, self.group.channels))
        tensor = _port_tensors(node, port)
        group = self.group
        slices = [replace(s, tensor=tensor.name, offset=offset) for s in getattr(role, "slices", [])]
        if isinstance(role, Cut):
            raise _CutFound(role.at)
        if isinstance(role, Regroup):
            if self.regroup:
                raise _RegroupFound(role)
            role = Blocked(role.reason if role.tentative else
                           f"{role.reason}, read from a range of a tensor or in another unit")
        if isinstance(role, Blocked):
            group.blockers.append(role.reason)
        elif isinstance(role, Producer):
            group.producers.extend([node.name] if node.name not in group.producers else [])
            group.slices.extend(slices)
        elif isinstance(role, Consumer):
            if all(c.node != node.name for c in group.consumers):
                group.consumers.append(ConsumerUse(node.name, role.kind, tensor.name, repeat))
            group.slices.extend(slices)
        elif isinstance(role, Channelwise):
            group.slices.extend(s for s in slices if s not in group.slices)
            attrs = [replace(a, offset=offset) for a in role.attrs]
            group.attrs.extend(a for a in attrs if a not in group.attrs)
            group.resizes.extend(r for r in role.resizes if r not in group.resizes)
            base = offset - role.frames.get(port, 0)
            for other, (o_axis, o_repeat) in role.ports.items():
                o_offset = base + role.frames.get(other, 0)
                self.visited.add((node.name, other, o_offset))
                self.add_tensor(_port_tensors(node, other), o_axis, o_repeat, o_offset)
            for tensor, t_axis, t_repeat in role.tied:
                self.add_tensor(tensor, t_axis, t_repeat, base)
        if isinstance(role, (Producer, Consumer)) and (node.name in group.gates or node.name in group.producers and any(
                c.node == node.name for c in group.consumers)):
            # A gate of one conv (VoVNet's effective squeeze-excitation: the pooled channels to a gate of the same
            # channels): its rows and columns are sliced together, and it is neither refitted nor a source of
            # the channels (exact where the dropped channels are zero, as a channel-wise op's constants are).
            group.gates.extend([node.name] if node.name not in group.gates else [])
            group.producers[:] = [p for p in group.producers if p != node.name]
            group.consumers[:] = [c for c in group.consumers if c.node != node.name]

    def run(self) -> None:
        while self.queue:
            tensor, axis, repeat, offset = self.queue.popleft()
            for node in list(tensor.inputs):
                self.visit(node, ("out", node.outputs.index(tensor)), axis, repeat, offset)
            for node in list(tensor.outputs):
                owner = self.owners.get(id(node))
                if owner is not None:
                    self.group.blockers.append(f"{owner.op} {owner.name} reads the channels inside its subgraph, "
                                               "which is left as it is")
                    continue
                for k, inp in enumerate(node.inputs):
                    if inp is tensor:
                        self.visit(node, ("in", k), axis, repeat, offset)


def _search(graph: gs.Graph, node: gs.Node, axis: int, starts: list[int], length: int, unit: int = 1,
            regroup: bool = True, units: str = "conv groups") -> Group:
    """The group seeded by entries [start, start + length) of producer ``node``'s output at each of ``starts`` (the
    same channels twice where ranges of it reach one tensor as the same channels), ``unit`` entries a channel,
    ``units`` what one is (``regroup`` False: a grouped conv that would need another unit blocks the group)."""
    group = Group(id=-1, channels=length // unit, unit=unit, units=units)
    search = _Search(graph, group, regroup)
    out = node.outputs[0]
    group.producers.append(node.name)
    for start in starts:
        search.visited.add((node.name, ("out", 0), start // unit))
        role = role_of(node, ("out", 0), axis, unit, (start // unit, length // unit))
        if isinstance(role, Blocked):
            group.blockers.append(role.reason)
            group.tensors[out.name] = (axis, unit)
            group.offsets.setdefault(out.name, []).append(start // unit)
            continue
        group.slices.extend(replace(s, tensor=out.name, offset=start // unit) for s in role.slices)
        search.add_tensor(out, axis, unit, start // unit)
    search.run()
    return group


def _sharing(groups: list[Group]) -> list[list[int]]:
    """Clusters (of two or more) of ``groups`` that hold one tensor at one offset: ranges of a producer's output that
    reach a tensor as the same channels (a residual sum of a 1×1 conv's output with Ghost's concatenation of a
    conv's output and a depthwise conv of it)."""
    owner: dict[tuple[str, int], int] = {}
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, group in enumerate(groups):
        for name, offsets in group.offsets.items():
            for offset in offsets:
                j = owner.setdefault((name, offset), i)
                parent[root(i)] = root(j)
    clusters: dict[int, list[int]] = {}
    for i in range(len(groups)):
        clusters.setdefault(root(i), []).append(i)
    return [c for c in clusters.values() if len(c) > 1]


def _pieces_of(graph: gs.Graph, node: gs.Node, axis: int, channels: int) -> list[Group]:
    """The groups of a producer's output: one range at first, cut wherever a Split/Slice/Concat needs; where a
    grouped conv reads the whole output, one channel is a conv group's entries, where a reshape splits it into heads
    a head's, if that leaves the group unblocked (``Regroup``)."""
    bounds, unit, regroup_ok, units, tentative = [0, channels], 1, True, "conv groups", False
    before = unit, units  # the unit a tentative regroup started from
    while True:
        groups = []
        try:
            for a, b in zip(bounds, bounds[1:]):
                groups.append(_search(graph, node, axis, [a], b - a, unit, regroup_ok, units))
                groups[-1].piece = f"[{a}:{b}]" if len(bounds) > 2 else ""
            merged_away: set[int] = set()
            for cluster in _sharing(groups):
                ranges = [(bounds[i], bounds[i + 1]) for i in cluster]
                if len({b - a for a, b in ranges}) > 1:
                    where = ", ".join(f"[{a}:{b}]" for a, b in ranges)
                    for i in cluster:
                        groups[i].blockers.append(f"{node.op} {node.name}: its channels {where} reach one tensor as "
                                                  "the same channels, in ranges of unequal widths")
                    continue
                merged = _search(graph, node, axis, [a for a, _ in ranges], ranges[0][1] - ranges[0][0], unit,
                                 regroup_ok, units)
                merged.piece = "+".join(f"[{a}:{b}]" for a, b in ranges)
                groups[cluster[0]] = merged
                merged_away.update(cluster[1:])
            groups = [g for i, g in enumerate(groups) if i not in merged_away]
            if tentative and any(g.blockers for g in groups):  # the unit before it stands, with the reason
                bounds, (unit, units), regroup_ok, tentative = [0, channels], before, False, False
                continue
            return groups
        except _CutFound as cut:
            a = bounds[len(groups)]
            bounds = sorted(set(bounds) | {a + int(c) * unit for c in cut.at})
        except _RegroupFound as regroup:
            # not of a range; over a unit already wider than a channel only a tentative one (heads of conv groups,
            # EfficientViT's), tried from that unit
            if len(bounds) > 2 or not regroup_ok or unit > 1 and not regroup.role.tentative:
                bounds, unit, regroup_ok = [0, channels], 1, False
            else:
                before = unit, units
                unit, units, tentative = unit * regroup.role.unit, regroup.role.what, regroup.role.tentative


def _finish(group: Group, tensor_map: dict[str, gs.Tensor]) -> None:
    """Check every member's size against its ranges and pick the witness (a tensor of exactly the group)."""
    for name, (t_axis, repeat) in group.tensors.items():
        dims = static_shape(tensor_map[name])
        size = None if dims is None or t_axis >= len(dims) else dims[t_axis]
        need = (max(group.offsets[name]) + group.channels) * repeat
        if size is not None and size < need:
            group.blockers.append(f"tensor {name} has {size} entries on the channel axis, "
                                  f"expected at least {group.channels}×{repeat} from offset {max(group.offsets[name])}")
        whole = size == group.channels * repeat and group.offsets[name] == [0]
        group.partial = group.partial or not whole
        if group.witness is None and whole:
            group.witness = (name, t_axis, repeat)
    if group.witness is None and group.consumers and not group.blockers:
        group.blockers.append(f"no tensor holds exactly the {group.channels} channels of {group.name}")


def find_groups(graph: gs.Graph) -> list[Group]:
    """Every channel space that starts at a Conv/ConvTranspose/Gemm/MatMul output, in graph order."""
    groups: list[Group] = []
    assigned: set[str] = set()
    tensor_map = graph.tensors()
    layout = Layout()
    for node in graph.nodes:
        if node.op not in PRODUCER_OPS or not node.outputs or node.outputs[0].name in assigned:
            continue
        axis = lookup(node.op).mixing.axis(node)
        shape = static_shape(node.outputs[0])
        if axis is None or shape is None or shape[axis] is None:
            continue
        if isinstance(role_of(node, ("out", 0), axis, 1, (0, shape[axis])), (Channelwise, Regroup)):
            continue  # depthwise or grouped conv: part of its input's space
        for group in _pieces_of(graph, node, axis, int(shape[axis])):
            group.id = len(groups)
            group.layout = layout
            _finish(group, tensor_map)
            assigned.update(group.tensors)
            groups.append(group)
    for group in groups:
        for name, offsets in group.offsets.items():
            layout.segments.setdefault(name, []).extend((o, group.channels, group.witness) for o in offsets)
    return groups


def is_gate(node: gs.Node) -> bool:
    """A producer with one value per channel and sample (an SE excitation conv on a pooled map, or a Gemm)."""
    shape = static_shape(node.outputs[0])
    return shape is not None and len(shape) >= 2 and all(d == 1 for d in shape[2:])
