"""Shape ops: Shape, Size, Reshape, Flatten, Squeeze, Unsqueeze, Transpose, Expand, Tile."""

from __future__ import annotations

import math

import numpy as np
import onnx_graphsurgeon as gs
import torch

from onnxprune.ir.graph import const_value, shape_entry, shape_producer, static_shape
from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Regroup, ResizeSite, Role, Span, rank_of
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, axis_of, given, ints


def _transpose_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    perm = list(node.attrs.get("perm", []))
    if not perm or repeat != 1:
        return Blocked(f"Transpose {node.name}: no perm attribute or flattened channels")
    in_axis = axis if port[0] == "in" else perm[axis]
    return Channelwise({("in", 0): (in_axis, 1), ("out", 0): (perm.index(in_axis), 1)})


def _reshape_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """Shape ops are channel-wise when the channel axis survives as one axis (possibly merged with
    the trailing spatial axes, which makes each channel own ``repeat`` consecutive entries)."""
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"{node.op} {node.name}: channels reach a shape input")
    i_shape, o_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    if i_shape is None or o_shape is None:
        return Blocked(f"{node.op} {node.name}: unknown shapes")
    if port == ("out", 0):
        in_axis = _same_axis(o_shape, i_shape, axis)
        if in_axis is not None:
            return _kept_axis(node, in_axis, axis, repeat, i_shape)
        regrouped = _regrouped(node, port, axis, repeat, span, i_shape, o_shape)
        return regrouped or Blocked(f"{node.op} {node.name} builds these channels out of other axes (an RNN's "
                                    "gates split from one vector, say): a channel here is not one channel before it")
    lead = i_shape[:axis]
    inner = i_shape[axis + 1:]
    out_axis = _same_axis(i_shape, o_shape, axis)
    if out_axis is not None:
        return _kept_axis(node, axis, out_axis, repeat, i_shape)
    # Case 2: flatten of [*lead, C, *spatial] into [*lead, C*prod(spatial)].
    if None in inner or len(o_shape) != axis + 1 or o_shape[:axis][1:] != lead[1:]:
        return _regrouped(node, port, axis, repeat, span, i_shape, o_shape) or Blocked(
            f"{node.op} {node.name}: reshapes across the channel axis")
    spatial = int(np.prod(inner)) if inner else 1
    channels = i_shape[axis]
    if channels is None or o_shape[axis] not in (None, channels * spatial):
        return Blocked(f"{node.op} {node.name}: reshapes across the channel axis")
    role = Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat * spatial)})
    if node.op == "Reshape":
        target = const_value(node.inputs[1])
        if target is None:
            return Blocked(f"Reshape {node.name}: its target shape is computed at run time (from the batch size or "
                           "the data), so it cannot be re-sized")
        if len(target) != axis + 1:
            return Blocked(f"Reshape {node.name}: reshapes across the channel axis")
        if int(target[-1]) != -1:
            if -1 in target.tolist() and (span[0] != 0 or span[1] * repeat != channels):
                return Blocked(f"Reshape {node.name}: its target fixes the flattened width ({int(target[-1])})")
            role.resizes.append(ResizeSite(node.name, node.inputs[0].name, axis, (0, span[1]), repeat * spatial))
    return role


def _split_of(merged: list[int | None], split: list[int | None], axis: int) -> int | None:
    """How many entries of ``merged``'s axis ``axis`` each index of ``split``'s axis ``axis`` spans, where ``split`` is
    ``merged`` with that axis split in two or more (``[B, N, D]`` -> ``[B, N, H, D/H]``: D/H), every axis before it kept
    (the batch may differ, as where rows fold into it) and the axes after it kept or regrouped among themselves
    (``[B, C, H, W]`` -> ``[B, heads, C/heads, H·W]``, EfficientFormer's heads: the same entries in row-major
    order); else None."""
    if axis >= len(merged) or axis >= len(split) or split[1:axis] != merged[1:axis]:
        return None
    tail, rest = merged[axis + 1:], split[axis + 1:]
    if None in tail or None in rest or split[axis] in (None, 0) or merged[axis] is None:
        return None
    if merged[axis] % split[axis] or merged[axis] == split[axis]:
        return None
    inner, k = merged[axis] // split[axis], 0
    while k < len(rest) and math.prod(rest[:k]) < inner:
        k += 1
    return inner if k and math.prod(rest[:k]) == inner and math.prod(rest[k:]) == math.prod(tail) else None


def _regrouped(node: gs.Node, port: Port, axis: int, repeat: int, span: Span, i_shape: list[int | None],
               o_shape: list[int | None]) -> Role | None:
    """A reshape that splits the channel axis into (channels, entries each) or merges them back (an attention's
    heads: ``[B, N, D]`` <-> ``[B, N, H, D/H]``), the space on the outer axis: channel-wise where a channel of the
    space spans whole indices of it; where the space arrives one entry a channel, a unit of those entries (a head)
    becomes its channel (``Regroup``); None where the shapes are not such a split."""
    here, there = (i_shape, o_shape) if port[0] == "in" else (o_shape, i_shape)
    inner = _split_of(here, there, axis)
    if inner is not None:  # the space arrives at the merged side
        if repeat % inner:  # a head holds several channels of the space (of conv groups: EfficientViT's q, k, v)
            return Regroup(inner // repeat, f"{node.op} {node.name}: reshapes across the channel axis", "heads",
                           tentative=True) if inner % repeat == 0 else None
        out_repeat = repeat // inner
    else:  # at the split side, a channel spanning ``inner`` of the merged axis
        inner = _split_of(there, here, axis)
        if inner is None:
            return None
        out_repeat = repeat * inner
    role = Channelwise({port: (axis, repeat), ("in" if port[0] == "out" else "out", 0): (axis, out_repeat)})
    partial = span[0] != 0 or span[1] * repeat != here[axis]  # the axis holds other channels too
    if node.op != "Reshape":
        return Blocked(f"{node.op} {node.name}: splits or merges a channel axis that holds other channels too") \
            if partial else role
    entry, target = shape_entry(node.inputs[1], axis), const_value(node.inputs[1])
    if entry == -1:  # the count follows the input, whatever other channels the axis holds
        return role
    if entry != o_shape[axis] or target is None or partial and -1 in np.delete(target.reshape(-1), axis):
        return Blocked(f"Reshape {node.name}: its target fixes the channel count ({entry})")
    role.resizes.append(ResizeSite(node.name, node.inputs[0].name, axis, (0, span[1]), role.ports[("out", 0)][1]))
    return role


def _same_axis(src: list[int | None], dst: list[int | None], axis: int) -> int | None:
    """Where axis ``axis`` of shape ``src`` is in ``dst`` when a reshape between them keeps it as one axis of the
    same size: only size-1 axes inserted or removed, or the same leading dims with the trailing ones merged or split
    (``[N, C, H, W]`` ↔ ``[N, C, H·W]``, Paddle's flatten(2)), or the axis and all after it unchanged with the
    leading ones merged or split (``[N, 64, C]`` ↔ ``[4·N, 16, C]``, patches folded into the batch); else None."""
    non1_src = [(i, d) for i, d in enumerate(src) if d != 1]
    non1_dst = [(i, d) for i, d in enumerate(dst) if d != 1]
    if [d for _, d in non1_src] == [d for _, d in non1_dst] and None not in [d for _, d in non1_src][1:]:
        positions = [i for i, _ in non1_src]
        if axis in positions:
            return non1_dst[positions.index(axis)][0]
    tail_src, tail_dst = src[axis + 1:], dst[axis + 1:]
    if (len(dst) > axis and dst[:axis] == src[:axis] and dst[axis] in (None, src[axis])
            and None not in tail_src and None not in tail_dst and math.prod(tail_src) == math.prod(tail_dst)):
        return axis
    suffix = src[axis:]
    if None not in suffix and len(dst) >= len(suffix) and dst[len(dst) - len(suffix):] == suffix:
        return len(dst) - len(suffix)
    return None


def _kept_axis(node: gs.Node, axis: int, out_axis: int, repeat: int, i_shape: list[int | None]) -> Role:
    """A shape op that keeps the channel axis as one axis (``out_axis`` of its output). A Reshape target that
    writes the channel count there as a constant is rewritten to the pruned count (``_resize_reshape``)."""
    role = Channelwise({("in", 0): (axis, repeat), ("out", 0): (out_axis, repeat)})
    if node.op != "Reshape":
        return role
    entry = shape_entry(node.inputs[1], out_axis)
    copied = entry == 0 and out_axis == axis and not node.attrs.get("allowzero", 0)
    if entry is None or entry == -1 or copied:
        return role
    if entry == i_shape[axis] and const_value(node.inputs[1]) is not None:
        role.resizes.append(ResizeSite(node.name, node.inputs[0].name, out_axis, (0, entry)))
        return role
    return Blocked(f"Reshape {node.name}: target shape fixes the channel count ({entry})")


def _resize_reshape(node: gs.Node, site: ResizeSite, bounds: list[int], tag: int, graph: gs.Graph) -> None:
    """Rewrite entry ``site.axis`` of a Reshape's constant target, which held the channel count (or, for a flatten,
    the channels' entries): -1 ("the rest") when no other entry is, else the count ``bounds[1] - bounds[0]`` (the
    input's channel axis after slicing) times the entries a channel holds there (``site.per``)."""
    others = np.delete(np.asarray(node.inputs[1].values).reshape(-1), site.axis).tolist()
    _set_target_entry(node, site.axis, -1 if -1 not in others else (bounds[1] - bounds[0]) * site.per, tag)


def _set_target_entry(node: gs.Node, index: int, value: int, tag: int) -> None:
    """Entry ``index`` of ``node``'s constant shape input (a Reshape's or Expand's target) set to ``value``, in a
    constant of the node's own (a target several nodes share is rewritten for each)."""
    target = np.array(np.asarray(node.inputs[1].values), dtype=np.int64).reshape(-1)
    target[index] = value
    node.inputs[1] = gs.Constant(f"{node.inputs[1].name}.{node.name}.keep{tag}", target)


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


def _shape_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """Shape reads sizes, not values: a member of the space when nothing reads the channel count
    (e.g. the batch size of a ``Reshape(x, [Shape(x)[0], -1])``)."""
    rank = rank_of(node.inputs[0])
    if port != ("in", 0) or rank is None:
        return Blocked(f"Shape {node.name}: unknown rank")
    start, end = int(node.attrs.get("start", 0)), int(node.attrs.get("end", rank))
    start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else min(end, rank))
    role = Channelwise({("in", 0): (axis, repeat)})
    if start <= axis < end:
        for vector, user in _readers(node.outputs[0]):
            if user.op == "Expand" and _whole_shape_of(user.inputs[1]) is node.inputs[0] and rank_of(
                    user.outputs[0]) == rank:  # x.expand_as(t): the Expand's output carries t's channels
                role.tied.append((user.outputs[0], axis, repeat))
                continue
            read = _indices(user, end - start) if user.inputs[0] is vector else None
            if read is None or axis - start in read:
                return Blocked(f"Shape {node.name}: the channel count is read by {user.op} {user.name}")
    return role


def _whole_shape_of(vector: gs.Tensor) -> gs.Tensor | None:
    """The tensor t where ``vector`` is ``Shape(t)`` over all of t's axes (past integer Casts), else None."""
    node = shape_producer(vector)
    if node is None or node.op != "Shape":
        return None
    rank = rank_of(node.inputs[0])
    if rank is None:
        return None
    start, end = int(node.attrs.get("start", 0)), int(node.attrs.get("end", rank))
    return node.inputs[0] if start in (0, -rank) and end >= rank else None


def _expand_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    """Expand broadcasts its input to a target shape: channel-wise where its input holds the channels and the
    target's entry for them is 1 or a constant count (rewritten to 1: "as the input"), or where the target is
    ``Shape(t)`` (``expand_as``: t then carries the same channels, its count follows; the input may be one entry
    broadcast to them)."""
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"Expand {node.name}: channels reach its shape input")
    i_shape, o_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    if i_shape is None or o_shape is None:
        return Blocked(f"Expand {node.name}: unknown shapes")
    lead = len(o_shape) - len(i_shape)
    out_axis = axis + lead if port == ("in", 0) else axis
    held = out_axis >= lead and i_shape[out_axis - lead] == o_shape[out_axis]
    if port == ("in", 0) and not held:
        return Blocked(f"Expand {node.name}: broadcasts the channels' axis")
    role = Channelwise({("out", 0): (out_axis, repeat), **({("in", 0): (out_axis - lead, repeat)} if held else {})})
    source = _whole_shape_of(node.inputs[1])
    if source is not None and rank_of(source) == len(o_shape):
        role.tied.append((source, out_axis, repeat))
        return role
    if not held:
        return Blocked(f"Expand {node.name}: broadcasts one entry to the channels, their count fixed by its target")
    target = const_value(node.inputs[1])
    length = len(o_shape) if target is None else target.size
    index = out_axis - (len(o_shape) - length)
    entry = 1 if index < 0 else shape_entry(node.inputs[1], index)
    if entry == 1:
        return role
    if target is None or entry != o_shape[out_axis]:
        return Blocked(f"Expand {node.name}: its target shape is computed at run time, the channel count in it "
                       "unknown")
    role.resizes.append(ResizeSite(node.name, node.inputs[0].name, index, (0, span[1]), repeat))
    return role


def _resize_expand(node: gs.Node, site: ResizeSite, bounds: list[int], tag: int, graph: gs.Graph) -> None:
    """Entry ``site.axis`` of an Expand's constant target, which held the channel count, set to 1 (the input's)."""
    _set_target_entry(node, site.axis, 1, tag)


def _readers(vector: gs.Tensor) -> list[tuple[gs.Tensor, gs.Node]]:
    """The nodes reading the shape vector ``vector``, past Casts (as Paddle exports write them), each with the
    tensor it reads."""
    out = []
    for user in vector.outputs:
        if user.op == "Cast" and user.inputs[0] is vector:
            out.extend(_readers(user.outputs[0]))
        else:
            out.append((vector, user))
    return out


def _shape(node: OpNode, x: Inputs) -> Tensor:
    dims = list(x[0].shape)
    rank = len(dims)
    start = node.get("start", 0)
    end = node.get("end", rank)
    start = min(max(axis_of(start, rank), 0), rank)
    end = min(max(axis_of(end, rank), 0), rank)
    return torch.tensor(dims[start:end], dtype=torch.int64, device=x[0].device)


def _size(node: OpNode, x: Inputs) -> Tensor:
    return torch.tensor(x[0].numel(), dtype=torch.int64, device=x[0].device)


def _flatten(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axis = axis_of(node.get("axis", 1), t.dim())
    return t.reshape(math.prod(t.shape[:axis]), math.prod(t.shape[axis:]))


def _reshaped(node: OpNode, t: Tensor, shape: list[int]) -> Tensor:
    if not node.get("allowzero", 0):
        shape = [t.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return t.reshape(shape)


def _reshape_1(node: OpNode, x: Inputs) -> Tensor:
    """Reshape before opset 5: the shape is an attribute."""
    return _reshaped(node, x[0], list(node.get("shape")))


def _reshape_5(node: OpNode, x: Inputs) -> Tensor:
    """Reshape from opset 5: the shape is an input."""
    return _reshaped(node, x[0], ints(x[1]))


def _transpose(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    perm = node.get("perm") or list(reversed(range(t.dim())))
    return t.permute(*perm)


def _squeeze(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axes = node.get("axes")
    if axes is None:
        axes = ints(given(x, 1))
    if not axes:
        return t.squeeze()
    return t.squeeze(tuple(axis_of(a, t.dim()) for a in axes))


def _unsqueeze(node: OpNode, x: Inputs) -> Tensor:
    t = x[0]
    axes = node.get("axes")
    if axes is None:
        axes = ints(x[1])
    rank = t.dim() + len(axes)
    for a in sorted(axis_of(a, rank) for a in axes):
        t = t.unsqueeze(a)
    return t


def _expand(node: OpNode, x: Inputs) -> Tensor:
    shape = torch.broadcast_shapes(tuple(x[0].shape), tuple(ints(x[1])))
    return x[0].expand(shape)


def _tile(node: OpNode, x: Inputs) -> Tensor:
    return x[0].repeat(ints(x[1]))


register(OpEntry("Shape", channels=_shape_rule, torch={1: _shape}))
register(OpEntry("Size", torch={1: _size}))
register(OpEntry("Flatten", channels=_reshape_rule, torch={1: _flatten}))
register(OpEntry("Reshape", channels=_reshape_rule, resize=_resize_reshape, torch={1: _reshape_1, 5: _reshape_5},
                 static_inputs=frozenset({1})))
register(OpEntry("Transpose", channels=_transpose_rule, torch={1: _transpose}))
register(OpEntry("Squeeze", channels=_reshape_rule, torch={1: _squeeze}, static_inputs=frozenset({1})))
register(OpEntry("Unsqueeze", channels=_reshape_rule, torch={1: _unsqueeze}, static_inputs=frozenset({1})))
register(OpEntry("Expand", channels=_expand_rule, resize=_resize_expand, torch={1: _expand},
                 static_inputs=frozenset({1})))
register(OpEntry("Tile", torch={1: _tile}, static_inputs=frozenset({1})))
