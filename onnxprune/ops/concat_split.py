"""Concat, Split, Slice: channel rules (ranges of a channel axis), slicing their bounds, torch kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_graphsurgeon as gs
import torch

from onnxprune.ir.graph import const_value
from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Cut, Port, ResizeSite, Role, Span, channels_at, rank_of
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, axis_of, given, ints

# ---- channel rules


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


def _piece(node: gs.Node, port: Port, side: str, sizes: list[int], span: Span, what: str) -> int | Cut:
    """Which of the pieces on ``side`` (Concat inputs, Split outputs) the space is in: the port's own,
    else the piece holding ``span``, or a Cut where the span straddles pieces."""
    if port[0] == side:
        return port[1]
    cut = _cut(node, sizes, span, what)
    return cut if cut is not None else _pieces(sizes, span)[0]


def _concat_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """On another axis: channel-wise. On the channel axis: input i's channels are the range of the
    output that starts at the sizes of inputs 0..i-1 (in channels of ``repeat`` entries: flattened maps, conv
    groups, where every input is made of whole ones)."""
    rank = rank_of(node.outputs[0])
    if rank is None:
        return Blocked(f"Concat {node.name}: unknown rank")
    if int(node.attrs["axis"]) % rank != axis:
        ports = {("in", i): (axis, repeat) for i in range(len(node.inputs))}
        ports[("out", 0)] = (axis, repeat)
        return Channelwise(ports)
    sizes = [channels_at(t, axis) for t in node.inputs]
    if None in sizes:
        return Blocked(f"Concat {node.name}: concatenates inputs of unknown channel count")
    if any(size % repeat for size in sizes):
        return Blocked(f"Concat {node.name}: concatenates flattened channels or whole conv groups ({repeat} entries "
                       "each) with inputs not made of whole ones")
    sizes = [size // repeat for size in sizes]  # in the space's channels
    i = _piece(node, port, "in", sizes, span, "joins two inputs")
    if isinstance(i, Cut):
        return i if repeat == 1 else Blocked(f"Concat {node.name}: joins two inputs inside a range of channels of "
                                             f"{repeat} entries each")
    start = int(sum(sizes[:i]))
    return Channelwise({("in", i): (axis, repeat), ("out", 0): (axis, repeat)},
                       frames={("in", i): 0, ("out", 0): start})


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


def _split_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """On another axis: channel-wise. On the channel axis: output j is the range of the input that
    starts at the sizes of pieces 0..j-1; pruning rewrites the sizes."""
    rank = rank_of(node.inputs[0])
    if rank is None or port[0] == "in" and port[1] != 0:
        return Blocked(f"Split {node.name}: unknown rank, or channels reach the split sizes")
    if int(node.attrs.get("axis", 0)) % rank != axis:
        ports = [("in", 0), *(("out", j) for j in range(len(node.outputs)))]
        return Channelwise({p: (axis, repeat) for p in ports})
    sizes = split_sizes(node, channels_at(node.inputs[0], axis))
    if repeat != 1 or sizes is None:
        return Blocked(f"Split {node.name}: splits flattened channels, or its sizes are not constant")
    j = _piece(node, port, "out", sizes, span, "splits")
    if isinstance(j, Cut):
        return j
    bounds = tuple(int(b) for b in np.cumsum([0, *sizes]))
    return Channelwise({("in", 0): (axis, 1), ("out", j): (axis, 1)}, frames={("in", 0): bounds[j], ("out", j): 0},
                       resizes=[ResizeSite(node.name, node.inputs[0].name, axis, bounds)])


def _slice_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """On other axes: channel-wise. On the channel axis (step 1): the output is the range [start, end)
    of the input; channels outside it end there. Pruning rewrites start and end."""
    if port not in (("in", 0), ("out", 0)) or len(node.inputs) < 3:
        return Blocked(f"Slice {node.name}: channels reach a parameter input, or a Slice before opset 10")
    rank = rank_of(node.inputs[0])
    params = [const_value(t) for t in node.inputs[1:]]
    if rank is None or any(p is None for p in params):
        return Blocked(f"Slice {node.name}: non-constant starts/ends/axes/steps")
    starts, ends = params[0].reshape(-1), params[1].reshape(-1)
    axes = [int(a) % rank for a in params[2].reshape(-1)] if len(params) > 2 else list(range(len(starts)))
    if axis not in axes:
        return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})
    k = axes.index(axis)
    steps = params[3].reshape(-1) if len(params) > 3 else np.ones(len(axes), np.int64)
    total = channels_at(node.inputs[0], axis)
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


# ---- the bounds after slicing


def _resize_split(node: gs.Node, site: ResizeSite, bounds: list[int], tag: int, graph: gs.Graph) -> None:
    """Rewrite a Split's sizes for the channel ``bounds`` of its pieces."""
    sizes = np.diff(bounds).astype(np.int64)
    if graph.opset >= 13:
        node.attrs.pop("num_outputs", None)
        split = gs.Constant(f"{node.name}.split{tag}", sizes)
        node.inputs = [node.inputs[0], split]
    else:
        node.attrs["split"] = [int(s) for s in sizes]


def _resize_slice(node: gs.Node, site: ResizeSite, bounds: list[int], tag: int, graph: gs.Graph) -> None:
    """Rewrite a Slice's start and end on the channel axis to ``bounds``."""
    rank = len(node.inputs[0].shape)
    params = [np.array(np.asarray(t.values), dtype=np.int64).reshape(-1) for t in node.inputs[1:]]
    axes = [int(a) % rank for a in params[2]] if len(params) > 2 else list(range(len(params[0])))
    k = axes.index(site.axis)
    params[0][k], params[1][k] = bounds
    for i in (0, 1):  # one constant per node: torch.onnx's chunk() shares a bound between its two Slices
        node.inputs[1 + i] = gs.Constant(f"{node.inputs[1 + i].name}.{node.name}.keep{tag}", params[i])


# ---- torch kernels


def _concat(node: OpNode, x: Inputs) -> Tensor:
    tensors = [t for t in x if t is not None]
    return torch.cat(tensors, axis_of(node.get("axis"), tensors[0].dim()))


def _split(node: OpNode, x: Inputs) -> list[Tensor]:
    t = x[0]
    axis = axis_of(node.get("axis", 0), t.dim())
    sizes = node.get("split")
    if sizes is None and given(x, 1) is not None:
        sizes = ints(x[1])
    dim = t.shape[axis]
    if not sizes:
        parts = node.get("num_outputs", node.num_outputs)
        chunk = -(-dim // parts)
        sizes = [min(chunk, dim - i * chunk) for i in range(parts)]
    return list(torch.split(t, list(sizes), axis))


def _sliced(t: Tensor, starts: list[int], ends: list[int], axes: list[int], steps: list[int]) -> Tensor:
    index: list[Any] = [slice(None)] * t.dim()
    flips: list[tuple[int, int, int, int]] = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = axis_of(axis, t.dim())
        dim = t.shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
            index[axis] = slice(start, max(start, end), step)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
            flips.append((axis, start, end, step))
    t = t[tuple(index)]
    for axis, start, end, step in flips:
        idx = torch.arange(start, end, step, device=t.device)
        t = t.index_select(axis, idx)
    return t


def _slice_1(node: OpNode, x: Inputs) -> Tensor:
    """Slice before opset 10: starts, ends and axes are attributes; no steps."""
    starts, ends = list(node.get("starts")), list(node.get("ends"))
    return _sliced(x[0], starts, ends, list(node.get("axes", range(len(starts)))), [1] * len(starts))


def _slice_10(node: OpNode, x: Inputs) -> Tensor:
    """Slice from opset 10: starts, ends, axes and steps are inputs."""
    starts, ends = ints(x[1]), ints(x[2])
    axes = ints(given(x, 3)) or list(range(len(starts)))
    return _sliced(x[0], starts, ends, axes, ints(given(x, 4)) or [1] * len(starts))


register(OpEntry("Concat", channels=_concat_rule, torch={1: _concat}))
register(OpEntry("Split", channels=_split_rule, resize=_resize_split, torch={1: _split}, static_inputs=frozenset({1})))
register(OpEntry("Slice", channels=_slice_rule, resize=_resize_slice, torch={1: _slice_1, 10: _slice_10},
                 static_inputs=frozenset({1, 2, 3, 4})))
