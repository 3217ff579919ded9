"""Per-op channel knowledge, keyed by ONNX ``op_type``.

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

A space may hold only part of a tensor's channel axis (one input of a channel-axis Concat, one
piece of a Split): ``span`` is its (offset, length) there, and ``Channelwise.frames`` shifts the
offset from port to port.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.graph import const_value, static_shape

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


@dataclass(frozen=True)
class AttrSite:
    """An integer attribute that must equal the new channel count (depthwise ``group``)."""

    node: str
    attr: str


@dataclass
class Channelwise:
    ports: dict[Port, tuple[int, int]]  # port -> (channel axis, repeat)
    slices: list[SliceSite] = field(default_factory=list)
    attrs: list[AttrSite] = field(default_factory=list)
    frames: dict[Port, int] = field(default_factory=dict)  # port -> where channel 0 of the node's frame sits
    resizes: list[ResizeSite] = field(default_factory=list)


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


Role = Channelwise | Producer | Consumer | Blocked | Cut
Rule = Callable[[gs.Node, Port, int, int, Span], Role]

RULES: dict[str, Rule] = {}


def rule(*ops: str) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule of each of ``ops``; a second rule for an op is a programming error."""
    def register(fn: Rule) -> Rule:
        for op in ops:
            if op in RULES:
                raise ValueError(f"{op} already has the rule {RULES[op].__name__}: one rule per op type")
            RULES[op] = fn
        return fn

    return register


def role_of(node: gs.Node, port: Port, axis: int, repeat: int, span: Span = (0, 0)) -> Role:
    """What ``node`` does with a channel space reaching ``port`` at ``axis`` (``span`` on that axis)."""
    fn = RULES.get(node.op)
    if fn is None:
        return Blocked(f"op {node.op} ({node.name}) is not known to be channel-wise")
    return fn(node, port, axis, repeat, span)


def _rank(tensor: gs.Tensor) -> int | None:
    shape = static_shape(tensor)
    return None if shape is None else len(shape)


@rule(
    "Relu", "Clip", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Elu", "Selu",
    "Softplus", "Softsign", "Identity", "Dropout", "Neg", "Abs", "Erf", "Mish", "Gelu", "Celu",
    "ThresholdedRelu", "Exp", "Sqrt", "Reciprocal", "Cast", "Floor", "Ceil", "Round", "Sin", "Cos",
    "Log", "Relu6",
)
def _unary(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port != ("in", 0) and port != ("out", 0):
        return Blocked(f"{node.op} {node.name}: channels reach a parameter input")
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})


def _per_channel_const(node: gs.Node, index: int, data_rank: int, axis: int, channels: int | None,
                       repeat: int) -> SliceSite | None | Blocked:
    """Slice site for a broadcast constant operand, None when it does not vary by channel."""
    value = const_value(node.inputs[index])
    if value is None:
        return Blocked(f"{node.name}: input {node.inputs[index].name} is not constant")
    if value.ndim == 0 or value.size == 1:
        return None
    c_axis = axis - (data_rank - value.ndim)
    if c_axis < 0 or value.shape[c_axis] == 1:
        return None
    if channels is not None and value.shape[c_axis] != channels * repeat:
        return Blocked(f"{node.name}: constant {node.inputs[index].name} has shape {value.shape}, "
                       "not broadcastable per channel")
    return SliceSite(node.name, index, c_axis, repeat)


def _channels_at(tensor: gs.Tensor, axis: int) -> int | None:
    shape = static_shape(tensor)
    return None if shape is None or axis >= len(shape) else shape[axis]


@rule("Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "PRelu", "Where")
def _broadcast(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """Elementwise n-ary op: tensors carrying the channel axis join the space, constants are sliced."""
    out = node.outputs[0]
    out_rank = _rank(out)
    here = node.inputs[port[1]] if port[0] == "in" else out
    here_rank = _rank(here)
    if out_rank is None or here_rank is None:
        return Blocked(f"{node.op} {node.name}: unknown tensor rank")
    out_axis = axis + (out_rank - here_rank)
    channels = _channels_at(out, out_axis)
    if node.op == "Where" and port == ("in", 0):
        return Blocked(f"Where {node.name}: channels reach the condition input")
    ports: dict[Port, tuple[int, int]] = {("out", 0): (out_axis, repeat)}
    slices: list[SliceSite] = []
    for i, tensor in enumerate(node.inputs):
        rank = _rank(tensor)
        if rank is None:
            return Blocked(f"{node.op} {node.name}: unknown rank of {tensor.name}")
        in_axis = out_axis - (out_rank - rank)
        if isinstance(tensor, gs.Constant):
            site = _per_channel_const(node, i, out_rank, out_axis, channels, repeat)
            if isinstance(site, Blocked):
                return site
            if site is not None:
                slices.append(site)
            continue
        dim = _channels_at(tensor, in_axis) if in_axis >= 0 else 1
        if dim == 1 and channels != 1:
            continue  # broadcast along channels (e.g. a spatial gate): channel-wise
        ports[("in", i)] = (in_axis, repeat)
    return Channelwise(ports, slices)


@rule("BatchNormalization", "InstanceNormalization")
def _norm(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"{node.op} {node.name}: channels reach a parameter input")
    if axis != 1:
        return Blocked(f"{node.op} {node.name}: channels are not on axis 1")
    params = range(1, len(node.inputs)) if node.op == "BatchNormalization" else (1, 2)
    slices = [SliceSite(node.name, i, 0) for i in params]
    return Channelwise({("in", 0): (1, 1), ("out", 0): (1, 1)}, slices)


@rule("MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "LpPool", "GlobalLpPool")
def _pool(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if axis != 1 or len(node.outputs) > 1 and node.outputs[1].outputs:
        return Blocked(f"{node.op} {node.name}: channels not on axis 1 or pooling indices used")
    return Channelwise({("in", 0): (1, 1), ("out", 0): (1, 1)})


@rule("Pad")
def _pad(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"Pad {node.name}: channels reach a parameter input")
    pads = const_value(node.inputs[1]) if len(node.inputs) > 1 else np.asarray(node.attrs.get("pads", []))
    if pads is None:
        return Blocked(f"Pad {node.name}: pads are not constant")
    rank = len(pads) // 2
    if len(node.inputs) > 3 and node.inputs[3] is not None and const_value(node.inputs[3]) is not None:
        axes = [int(a) % rank for a in const_value(node.inputs[3])]
        rank = _rank(node.inputs[0]) or rank
    else:
        axes = list(range(rank))
    for j, ax in enumerate(axes):
        if ax == axis and (pads[j] != 0 or pads[j + len(axes)] != 0):
            return Blocked(f"Pad {node.name}: pads the channel axis")
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})


@rule("Resize", "Upsample")
def _resize(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"{node.op} {node.name}: channels reach a parameter input")
    i_shape, o_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    if not i_shape or not o_shape or i_shape[axis] != o_shape[axis]:
        return Blocked(f"{node.op} {node.name}: may resize the channel axis")
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})


@rule("Transpose")
def _transpose(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    perm = list(node.attrs.get("perm", []))
    if not perm or repeat != 1:
        return Blocked(f"Transpose {node.name}: no perm attribute or flattened channels")
    in_axis = axis if port[0] == "in" else perm[axis]
    return Channelwise({("in", 0): (in_axis, 1), ("out", 0): (perm.index(in_axis), 1)})


@rule("Squeeze", "Unsqueeze", "Flatten", "Reshape")
def _reshape(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """Shape ops are channel-wise when the channel axis survives as one axis (possibly merged with
    the trailing spatial axes, which makes each channel own ``repeat`` consecutive entries)."""
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"{node.op} {node.name}: channels reach a shape input")
    i_shape, o_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    if i_shape is None or o_shape is None:
        return Blocked(f"{node.op} {node.name}: unknown shapes")
    if port == ("out", 0):
        return Blocked(f"{node.op} {node.name}: channels traced backwards through a reshape")
    lead = i_shape[:axis]
    inner = i_shape[axis + 1:]
    # Case 1: only size-1 axes inserted/removed: the channel axis keeps its size.
    non1_in = [(i, d) for i, d in enumerate(i_shape) if d != 1]
    non1_out = [(i, d) for i, d in enumerate(o_shape) if d != 1]
    if [d for _, d in non1_in] == [d for _, d in non1_out] and None not in [d for _, d in non1_in][1:]:
        k = [i for i, _ in non1_in].index(axis) if axis in [i for i, _ in non1_in] else None
        if k is not None:
            out_axis = non1_out[k][0]
            if node.op == "Reshape":
                entry = _shape_entry(node.inputs[1], out_axis)
                copied = entry == 0 and out_axis == axis and not node.attrs.get("allowzero", 0)
                if entry is not None and entry != -1 and not copied:
                    return Blocked(f"Reshape {node.name}: target shape fixes the channel count ({entry})")
            return Channelwise({("in", 0): (axis, repeat), ("out", 0): (out_axis, repeat)})
    # Case 2: flatten of [*lead, C, *spatial] into [*lead, C*prod(spatial)].
    if None in inner or len(o_shape) != axis + 1 or o_shape[:axis][1:] != lead[1:]:
        return Blocked(f"{node.op} {node.name}: reshapes across the channel axis")
    spatial = int(np.prod(inner)) if inner else 1
    channels = i_shape[axis]
    if channels is None or o_shape[axis] not in (None, channels * spatial):
        return Blocked(f"{node.op} {node.name}: reshapes across the channel axis")
    if node.op == "Reshape":
        target = const_value(node.inputs[1])
        if target is None or len(target) != axis + 1 or int(target[-1]) not in (-1,):
            return Blocked(f"Reshape {node.name}: target shape must end in -1 to be re-sized")
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat * spatial)})


def _shape_entry(tensor: gs.Tensor, index: int) -> int | None:
    """Entry ``index`` of a shape vector that is a constant or a Concat of pieces, None if unknown."""
    value = const_value(tensor)
    if value is not None:
        return int(value.reshape(-1)[index]) if index < value.size else None
    node = tensor.inputs[0] if isinstance(tensor, gs.Variable) and len(tensor.inputs) == 1 else None
    if node is None or node.op != "Concat":
        return None
    for piece in node.inputs:
        shape = static_shape(piece)
        if shape is None or len(shape) != 1 or shape[0] is None:
            return None
        if index < shape[0]:
            return _shape_entry(piece, index)
        index -= shape[0]
    return None


def _indices(node: gs.Node, length: int) -> list[int] | None:
    """The entries of a length-``length`` vector that a Gather (axis 0) or Slice with constant
    parameters reads from its first input, else None."""
    if node.op == "Gather" and int(node.attrs.get("axis", 0)) == 0:
        index = const_value(node.inputs[1])
        return None if index is None else sorted({int(i) % length for i in index.reshape(-1)})
    if node.op == "Slice" and len(node.inputs) >= 3:
        params = [const_value(t) for t in node.inputs[1:]]
        if any(v is None for v in params) or any(v.size != 1 for v in params):
            return None
        starts, ends = int(params[0][0]), int(params[1][0])
        axes = int(params[2][0]) if len(params) > 2 else 0
        steps = int(params[3][0]) if len(params) > 3 else 1
        return None if axes not in (0, -1) or steps == 0 else list(range(length))[starts:ends:steps]
    return None


@rule("Shape")
def _shape(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """Shape reads sizes, not values: a member of the space when nothing reads the channel count
    (e.g. the batch size of a ``Reshape(x, [Shape(x)[0], -1])``)."""
    rank = _rank(node.inputs[0])
    if port != ("in", 0) or rank is None:
        return Blocked(f"Shape {node.name}: unknown rank")
    start, end = int(node.attrs.get("start", 0)), int(node.attrs.get("end", rank))
    start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else min(end, rank))
    if start <= axis < end:
        for user in node.outputs[0].outputs:
            read = _indices(user, end - start) if user.inputs[0] is node.outputs[0] else None
            if read is None or axis - start in read:
                return Blocked(f"Shape {node.name}: the channel count is read by {user.op} {user.name}")
    return Channelwise({("in", 0): (axis, repeat)})


@rule("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2", "ReduceL1", "ReduceProd",
      "ReduceLogSumExp", "ReduceSumSquare")
def _reduce(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    rank = _rank(node.inputs[0])
    axes = node.attrs.get("axes")
    if axes is None and len(node.inputs) > 1:
        value = const_value(node.inputs[1])
        axes = None if value is None else value.tolist()
    if rank is None or axes is None or port != ("in", 0) or repeat != 1:
        return Blocked(f"{node.op} {node.name}: reduces over all axes or unknown axes")
    axes = [int(a) % rank for a in axes]
    if axis in axes:
        return Blocked(f"{node.op} {node.name}: reduces across channels")
    keep = node.attrs.get("keepdims", 1)
    out_axis = axis if keep else axis - sum(a < axis for a in axes)
    return Channelwise({("in", 0): (axis, 1), ("out", 0): (out_axis, 1)})


@rule("Softmax", "LogSoftmax")
def _softmax(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    rank = _rank(node.inputs[0])
    if rank is None or int(node.attrs.get("axis", -1)) % rank == axis or repeat != 1:
        return Blocked(f"{node.op} {node.name}: normalises across channels")
    return Channelwise({("in", 0): (axis, 1), ("out", 0): (axis, 1)})


def _pieces(sizes: list[int], span: Span) -> tuple[int, list[int]]:
    """The piece holding ``span`` among consecutive pieces of ``sizes``, and the piece boundaries
    strictly inside the span (relative to its offset) when it straddles several."""
    bounds = np.cumsum([0, *sizes])
    offset, length = span
    piece = int(np.searchsorted(bounds, offset, side="right")) - 1
    inside = [int(b) - offset for b in bounds if offset < b < offset + length]
    return piece, inside


def _cut(node: gs.Node, sizes: list[int], span: Span, what: str) -> Cut | None:
    inside = _pieces(sizes, span)[1]
    return Cut(inside, f"{node.op} {node.name} {what} inside the channel range") if inside else None


@rule("Concat")
def _concat(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """On another axis: channel-wise. On the channel axis: input i's channels are the range of the
    output that starts at the sizes of inputs 0..i-1."""
    rank = _rank(node.outputs[0])
    if rank is None:
        return Blocked(f"Concat {node.name}: unknown rank")
    if int(node.attrs["axis"]) % rank != axis:
        ports = {("in", i): (axis, repeat) for i in range(len(node.inputs))}
        ports[("out", 0)] = (axis, repeat)
        return Channelwise(ports)
    sizes = [_channels_at(t, axis) for t in node.inputs]
    if repeat != 1 or None in sizes:
        return Blocked(f"Concat {node.name}: concatenates flattened channels or inputs of unknown size")
    if port[0] == "in":
        i = port[1]
    else:
        cut = _cut(node, sizes, span, "joins two inputs")
        if cut is not None:
            return cut
        i = _pieces(sizes, span)[0]
    start = int(sum(sizes[:i]))
    return Channelwise({("in", i): (axis, 1), ("out", 0): (axis, 1)}, frames={("in", i): 0, ("out", 0): start})


def split_sizes(node: gs.Node, total: int | None) -> list[int] | None:
    """The sizes of a Split's pieces (from the ``split`` input or attribute, else equal pieces)."""
    if len(node.inputs) > 1 and node.inputs[1].name:
        value = const_value(node.inputs[1])
        return None if value is None else [int(v) for v in value.reshape(-1)]
    if "split" in node.attrs:
        return [int(v) for v in node.attrs["split"]]
    if total is None:
        return None
    n = len(node.outputs)
    size = -(-total // n)
    return [size] * (n - 1) + [total - (n - 1) * size]


@rule("Split")
def _split(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """On another axis: channel-wise. On the channel axis: output j is the range of the input that
    starts at the sizes of pieces 0..j-1; pruning rewrites the sizes."""
    rank = _rank(node.inputs[0])
    if rank is None or port[0] == "in" and port[1] != 0:
        return Blocked(f"Split {node.name}: unknown rank, or channels reach the split sizes")
    if int(node.attrs.get("axis", 0)) % rank != axis:
        ports = [("in", 0), *(("out", j) for j in range(len(node.outputs)))]
        return Channelwise({p: (axis, repeat) for p in ports})
    sizes = split_sizes(node, _channels_at(node.inputs[0], axis))
    if repeat != 1 or sizes is None:
        return Blocked(f"Split {node.name}: splits flattened channels, or its sizes are not constant")
    if port[0] == "out":
        j = port[1]
    else:
        cut = _cut(node, sizes, span, "splits")
        if cut is not None:
            return cut
        j = _pieces(sizes, span)[0]
    bounds = tuple(int(b) for b in np.cumsum([0, *sizes]))
    return Channelwise({("in", 0): (axis, 1), ("out", j): (axis, 1)}, frames={("in", 0): bounds[j], ("out", j): 0},
                       resizes=[ResizeSite(node.name, node.inputs[0].name, axis, bounds)])


@rule("Slice")
def _slice(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """On other axes: channel-wise. On the channel axis (step 1): the output is the range [start, end)
    of the input; channels outside it end there. Pruning rewrites start and end."""
    if port not in (("in", 0), ("out", 0)) or len(node.inputs) < 3:
        return Blocked(f"Slice {node.name}: channels reach a parameter input, or a Slice before opset 10")
    rank = _rank(node.inputs[0])
    params = [const_value(t) for t in node.inputs[1:]]
    if rank is None or any(p is None for p in params):
        return Blocked(f"Slice {node.name}: non-constant starts/ends/axes/steps")
    starts, ends = params[0].reshape(-1), params[1].reshape(-1)
    axes = [int(a) % rank for a in params[2].reshape(-1)] if len(params) > 2 else list(range(len(starts)))
    if axis not in axes:
        return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})
    k = axes.index(axis)
    steps = params[3].reshape(-1) if len(params) > 3 else np.ones(len(axes), np.int64)
    total = _channels_at(node.inputs[0], axis)
    if repeat != 1 or int(steps[k]) != 1 or total is None:
        return Blocked(f"Slice {node.name}: steps over the channel axis, or slices flattened channels")
    start, end = slice(int(starts[k]), int(ends[k])).indices(total)[:2]
    end = max(start, end)
    site = [ResizeSite(node.name, node.inputs[0].name, axis, (start, end))]
    frames = {("in", 0): start, ("out", 0): 0}
    if port == ("in", 0):
        offset, length = span
        if offset + length <= start or offset >= end:  # not read: the channels end here
            return Channelwise({("in", 0): (axis, 1)}, resizes=site)
        cut = _cut(node, [start, end - start, total - end], span, "slices")
        if cut is not None:
            return cut
    return Channelwise({("in", 0): (axis, 1), ("out", 0): (axis, 1)}, frames=frames, resizes=site)


@rule("Conv")
def _conv(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    weight = const_value(node.inputs[1])
    if weight is None:
        return Blocked(f"Conv {node.name}: weight is not constant")
    group = int(node.attrs.get("group", 1))
    c_in = weight.shape[1] * group
    bias = [SliceSite(node.name, 2, 0)] if len(node.inputs) > 2 else []
    if group > 1 and weight.shape[1] == 1 and weight.shape[0] == group:
        # depthwise, multiplier 1: channel c in -> channel c out
        if port not in (("in", 0), ("out", 0)):
            return Blocked(f"Conv {node.name}: channels reach the weight input")
        return Channelwise({("in", 0): (1, 1), ("out", 0): (1, 1)},
                           [SliceSite(node.name, 1, 0), *bias], [AttrSite(node.name, "group")])
    if group > 1:
        return Blocked(f"Conv {node.name}: grouped convolution ({group} groups) ties channels per group")
    if port == ("out", 0):
        return Producer([SliceSite(node.name, 1, 0), *bias])
    if port == ("in", 0) and axis == 1 and repeat == 1 and c_in == weight.shape[1]:
        return Consumer("conv", [SliceSite(node.name, 1, 1)])
    return Blocked(f"Conv {node.name}: channels reach an unsupported input")


@rule("ConvTranspose")
def _conv_transpose(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    weight = const_value(node.inputs[1])
    if weight is None or int(node.attrs.get("group", 1)) != 1:
        return Blocked(f"ConvTranspose {node.name}: grouped or non-constant weight")
    if port == ("out", 0):
        bias = [SliceSite(node.name, 2, 0)] if len(node.inputs) > 2 else []
        return Producer([SliceSite(node.name, 1, 1), *bias])
    auto = node.attrs.get("auto_pad", "NOTSET")
    if auto not in ("NOTSET", b"NOTSET", "") or "output_shape" in node.attrs or weight.ndim != 4:
        return Blocked(f"ConvTranspose {node.name}: auto_pad, output_shape or not 2-D: not supported as a consumer")
    if port == ("in", 0) and axis == 1 and repeat == 1:
        return Consumer("conv_transpose", [SliceSite(node.name, 1, 0)])
    return Blocked(f"ConvTranspose {node.name}: channels reach an unsupported input")


@rule("Gemm")
def _gemm(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    weight = const_value(node.inputs[1])
    trans_a, trans_b = int(node.attrs.get("transA", 0)), int(node.attrs.get("transB", 0))
    if weight is None or trans_a:
        return Blocked(f"Gemm {node.name}: non-constant weight or transA")
    if port == ("out", 0):
        slices = [SliceSite(node.name, 1, 0 if trans_b else 1)]
        if len(node.inputs) > 2:
            bias = const_value(node.inputs[2])
            if bias is None:
                return Blocked(f"Gemm {node.name}: non-constant bias")
            if bias.size > 1 and bias.shape[-1] > 1:
                slices.append(SliceSite(node.name, 2, bias.ndim - 1))
        return Producer(slices)
    if port == ("in", 0) and axis == 1:
        return Consumer("gemm", [SliceSite(node.name, 1, 1 if trans_b else 0, repeat)])
    return Blocked(f"Gemm {node.name}: channels reach an unsupported input")


@rule("MatMul")
def _matmul(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    weight = const_value(node.inputs[1])
    if weight is None or weight.ndim != 2:
        return Blocked(f"MatMul {node.name}: weight is not a constant matrix")
    rank = _rank(node.outputs[0] if port[0] == "out" else node.inputs[0])
    if rank is None or axis != rank - 1:
        return Blocked(f"MatMul {node.name}: channels are not on the last axis")
    if port == ("out", 0):
        return Producer([SliceSite(node.name, 1, 1)])
    if port == ("in", 0):
        return Consumer("matmul", [SliceSite(node.name, 1, 0, repeat)])
    return Blocked(f"MatMul {node.name}: channels reach the weight input")
