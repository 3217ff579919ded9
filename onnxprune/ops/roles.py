"""Channel roles: what a node does with a channel space (the answers of the ops' channel rules).

A rule is called when a channel space (a set of tensors whose channel axis carries the same N
channels) reaches one port of a node. It answers what the node does with those channels:

* ``Channelwise`` — the node maps channel c to channel c only (BN, activations, depthwise conv,
  pooling, broadcast arithmetic). Every listed port belongs to the same space; listed constants are
  sliced along with the channels.
* ``Producer`` — reached from its output: the node creates the channels (Conv, Gemm, MatMul).
* ``Consumer`` — reached from its data input: the node mixes the channels linearly (Conv, Gemm,
  MatMul); its weight columns for a channel are sliced (``repeat`` columns per channel after a
  Flatten).
* ``Blocked`` — anything else, with the reason. Unknown ops are blocked, never guessed.
* ``Cut`` — the space reaches a Split/Slice/Concat boundary inside its channel range: the search
  restarts with the range cut there (a producer whose output is split becomes one group per piece).
* ``Regroup`` — the space reaches a grouped convolution whose groups split its channels, or a reshape that
  splits its channel axis into (heads, entries of a head): the search restarts with a conv group or a head as
  the unit (a "channel" of the space is then ``unit`` consecutive entries, kept or dropped together, as
  ``repeat`` counts them).

A space may hold only part of a tensor's channel axis (one input of a channel-axis Concat, one
piece of a Split): ``span`` is its (offset, length) there, and ``Channelwise.frames`` shifts the
offset from port to port.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_graphsurgeon as gs

from onnxprune.ir.graph import static_shape

Port = tuple[str, int]  # ("in", k) or ("out", k)
Span = tuple[int, int]  # (offset, length) of the space's channels on a tensor's channel axis


@dataclass(frozen=True)
class SliceSite:
    """A constant input of a node whose ``axis`` is indexed by channel (``repeat`` entries each)."""

    node: str
    input_index: int
    axis: int
    repeat: int = 1
    tensor: str = field(default="", compare=False)  # whose channel layout indexes ``axis`` (offsets move)
    offset: int = 0  # of the group's channels there, in the original graph


@dataclass(frozen=True)
class ResizeSite:
    """A Split or channel-axis Slice whose sizes / bounds must follow the channel layout of its input:
    ``bounds`` are its piece boundaries (Split) or (start, end) (Slice) in the original graph."""

    node: str
    tensor: str
    axis: int
    bounds: tuple[int, ...]
    per: int = 1  # entries of the node's output a channel holds there (a Reshape's target counts entries)


@dataclass(frozen=True)
class AttrSite:
    """An integer attribute that counts the channels, ``per`` of it each (a depthwise conv's ``group``: one per
    entry; a grouped conv's: one per unit): it loses ``per`` for every dropped channel."""

    node: str
    attr: str
    per: int = 1
    offset: int = 0  # of the group's channels in the node's input: a group there twice loses twice (Ghost's concat)


@dataclass
class Channelwise:
    ports: dict[Port, tuple[int, int]]  # port -> (channel axis, repeat)
    slices: list[SliceSite] = field(default_factory=list)
    attrs: list[AttrSite] = field(default_factory=list)
    frames: dict[Port, int] = field(default_factory=dict)  # port -> where channel 0 of the node's frame sits
    resizes: list[ResizeSite] = field(default_factory=list)
    tied: list[tuple[gs.Tensor, int, int]] = field(default_factory=list)  # (tensor, axis, repeat) off the node's
    # ports that must carry the same channels (an Expand to ``Shape(t)``'s target: t)


@dataclass
class Producer:
    slices: list[SliceSite]


@dataclass
class Consumer:
    kind: str  # "conv" | "gemm" | "matmul"
    slices: list[SliceSite]


@dataclass
class Blocked:
    reason: str


@dataclass
class Cut:
    at: list[int]  # boundaries strictly inside the span, relative to its offset
    reason: str


@dataclass
class Regroup:
    unit: int  # entries per channel of the space: the channels of one conv group, or of one head
    reason: str
    what: str = "conv groups"  # what a unit is, in the user's words
    tentative: bool = False  # where the unit leaves the group blocked, the search by single channels stands (and
    # ``reason`` blocks it there)


Role = Channelwise | Producer | Consumer | Blocked | Cut | Regroup
Rule = Callable[[gs.Node, Port, int, int, Span], Role]


def rank_of(tensor: gs.Tensor) -> int | None:
    shape = static_shape(tensor)
    return None if shape is None else len(shape)


def channels_at(tensor: gs.Tensor, axis: int) -> int | None:
    shape = static_shape(tensor)
    return None if shape is None or axis >= len(shape) else shape[axis]
