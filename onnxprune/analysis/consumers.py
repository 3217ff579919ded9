"""How a channel-mixing consumer reads its input as a matrix (each op's ``Mixing`` in ``onnxprune.ops``).

Every consumer is seen as ``t = W x + b`` over "positions": ``x`` is a column of the unfolded
input (D = channels × K entries, channel-major, K = kernel taps or flattened spatial size), ``W``
is (O, D). ``unfold`` gives (B, D, positions) in torch; ``matrix``/``write`` convert to and from
the op's own weight layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
import torch

from onnxprune.ir.graph import const_value, static_shape
from onnxprune.analysis.groups import ConsumerUse, Group
from onnxprune.errors import UnsupportedOpError
from onnxprune.ops.linear import bias_add
from onnxprune.ops.registry import Linear, Mixing, lookup, thin

__all__ = ["Cleared", "ColumnView", "Linear", "bias_add", "cleared", "columns", "group_view", "matrix", "parameters",
           "positions", "samples_per_chunk", "thin", "unfold", "unfold_every", "write"]


def _mixing(node: gs.Node) -> Mixing:
    entry = lookup(node.op)
    if entry is None or entry.mixing is None:
        raise UnsupportedOpError(f"{node.op} {node.name}: not a supported consumer")
    return entry.mixing


def matrix(node: gs.Node) -> Linear:
    """The consumer's weights as (O, D) plus bias."""
    return _mixing(node).matrix(node, const_value(node.inputs[1]).astype(np.float64))


def unfold(node: gs.Node, x: torch.Tensor) -> torch.Tensor:
    """What the consumer multiplies by W, channel-major: (B, D, positions)."""
    return _mixing(node).unfold(node, x)


def positions(node: gs.Node, shape: tuple[int, ...]) -> int:
    """Positions per sample of ``unfold`` on an input of ``shape`` (the op's arithmetic, else a meta tensor's
    unfolding: shapes only)."""
    known = _mixing(node).positions
    if known is not None:
        return known(node, tuple(shape))
    return unfold(node, torch.empty((1, *shape[1:]), device="meta")).shape[2]


def unfold_every(node: gs.Node, x: torch.Tensor, stride: int, first: int) -> torch.Tensor:
    """``thin(unfold(node, x), stride, first)``, without unfolding the dropped positions where the op knows how
    (a 3x3 conv at 320² keeping one position in 16 would unfold 16 times what it keeps)."""
    every = _mixing(node).unfold_every
    if stride == 1 or every is None:
        return thin(unfold(node, x), stride, first)
    return every(node, x, stride, first)


def samples_per_chunk(node: gs.Node, channels: int, columns: int, most: int, limit: int) -> int:
    """How many samples of ``node``'s unfolding fit in ``limit`` bytes of float32, ``columns`` values per position of
    its output (``channels`` per position): at most ``most``, at least 1 (``most`` where its shape is not known)."""
    shape = static_shape(node.outputs[0])
    if not shape or any(not isinstance(d, int) for d in shape[1:]):
        return most
    positions = max(1, math.prod(shape[1:]) // max(channels, 1))
    return max(1, min(most, limit // (4 * positions * columns)))


def columns(node: gs.Node, y: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like the consumer's output (or a Gemm/MatMul input) as (B, channels, positions),
    with positions in the order ``unfold`` uses."""
    return _mixing(node).columns(node, y)


def write(graph: gs.Graph, node: gs.Node, linear: Linear) -> None:
    """Store ``linear`` as the node's weights (in its own layout), adding a bias where needed."""
    dtype = np.asarray(node.inputs[1].values).dtype
    _mixing(node).write(graph, node, linear.weight.astype(dtype), linear.bias.astype(dtype))


def parameters(node: gs.Node) -> tuple[gs.Tensor, gs.Tensor | None]:
    """The tensors holding the node's weight and bias in its own layout (a MatMul's bias is its ``bias_add``'s;
    None: no bias yet)."""
    add = bias_add(node)
    slot = _mixing(node).bias_input
    if add is not None:
        return node.inputs[1], add.inputs[1]
    return node.inputs[1], node.inputs[slot] if slot is not None and len(node.inputs) > slot else None


@dataclass
class ColumnView:
    """A group's columns in one consumer's (O, D) matrix: ``cols`` channel-major (``k`` per group
    channel: kernel taps × entries per channel × the ranges it fills), ``rest`` the other groups' columns."""

    cols: np.ndarray
    rest: np.ndarray
    k: int

    def __post_init__(self) -> None:
        self.whole = not self.rest.size and bool(np.all(self.cols == np.arange(self.cols.size)))

    def linear(self, full: Linear) -> Linear:
        return Linear(full.weight if self.whole else full.weight[:, self.cols], full.bias, self.k)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of an unfolded input (B, D, positions)."""
        return x if self.whole else rows_of(x, self.cols)

    def take_rest(self, x: torch.Tensor) -> torch.Tensor:
        """The other groups' rows of an unfolded input (B, D, positions)."""
        return rows_of(x, self.rest)


def rows_of(x: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """``x[:, index]``: a view where ``index`` is a run of consecutive rows (a Concat's block, the usual case; the
    copy of an unfolded 3×3 input is gigabytes at 320²), else a gathered copy."""
    if index.size and index[-1] - index[0] == index.size - 1 and np.all(np.diff(index) == 1):
        return x[:, int(index[0]) : int(index[-1]) + 1]
    return x[:, torch.from_numpy(index)]


def group_view(graph: gs.Graph, node: gs.Node, group: Group, use: ConsumerUse) -> ColumnView:
    """Where ``group``'s channels sit among the consumer's columns in ``graph`` (pruned or original)."""
    full = matrix(node)
    taps = full.k  # kernel taps per channel column (1 for Gemm, MatMul)
    tensors = graph.tensors()
    width = group.width(tensors)
    entries = np.stack([group.entries(tensors, use.tensor, o, use.repeat) for o in group.offsets[use.tensor]])
    # (ranges, width·repeat) entries -> (width, ranges·repeat·taps) columns, channel-major
    entries = entries.reshape(len(entries), width, use.repeat).transpose(1, 0, 2).reshape(width, -1)
    cols = (entries[:, :, None] * taps + np.arange(taps)).reshape(-1)
    return ColumnView(cols, np.setdiff1d(np.arange(full.weight.shape[1]), cols), cols.size // max(width, 1))


@dataclass
class Cleared:
    """A consumer's whole (O, D) matrix with a group's columns zeroed (``base``), and where they are (``cols``)."""

    base: Linear
    cols: np.ndarray

    def with_group(self, cols: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> Linear:
        """The whole matrix with the group's columns ``cols`` (its own numbering) set to ``weight``, and ``bias``."""
        out = self.base.weight.copy()
        out[:, self.cols[cols]] = weight
        return Linear(out, bias, self.base.k)


def cleared(graph: gs.Graph, node: gs.Node, group: Group, use: ConsumerUse) -> Cleared:
    """``node``'s matrix in ``graph`` with ``group``'s columns zeroed (candidates write theirs in)."""
    base = matrix(node)
    cols = group_view(graph, node, group, use).cols
    base.weight[:, cols] = 0.0
    return Cleared(base, cols)
