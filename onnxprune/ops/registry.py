"""The op registry: one ``OpEntry`` per ONNX ``op_type`` (default domain) with all the tool knows of it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.errors import ShapeError
from onnxprune.ir.graph import const_value

if TYPE_CHECKING:
    import onnx
    import torch

    from onnxprune.ops.roles import ResizeSite, Rule
    from onnxprune.ops.kernel import OpFn, OpNode

Shape = list[int | None]


@dataclass
class Linear:
    """A consumer as a matrix: W (O, D), b (O), K columns per input channel."""

    weight: np.ndarray
    bias: np.ndarray
    k: int


def bias_of(node: gs.Node, n: int) -> np.ndarray:
    """The bias input (slot 2) of a Conv, ConvTranspose or Gemm in float64: ``n`` zeros where it has none."""
    return const_value(node.inputs[2]).astype(np.float64) if len(node.inputs) > 2 else np.zeros(n)


def set_bias(node: gs.Node, b: np.ndarray) -> None:
    """Make ``b`` the bias input (slot 2) of a Conv, ConvTranspose or Gemm."""
    bias = gs.Constant(f"{node.name}.bias", b)
    if len(node.inputs) > 2:
        node.inputs[2] = bias
    else:
        node.inputs.append(bias)


def thin(a: torch.Tensor, stride: int, first: int) -> torch.Tensor:
    """Every ``stride``-th position of a chunk (B, C, L), counted over its flattened positions from
    ``first`` so that the pattern runs on across samples and chunks: (1, C, M), or ``a`` itself."""
    if stride == 1:
        return a
    return a.transpose(0, 1).reshape(a.shape[1], -1)[:, first::stride].unsqueeze(0)


def _channel_axis_one(node: gs.Node) -> int | None:
    return 1


@dataclass(frozen=True)
class Mixing:
    """A channel-mixing op (producer and consumer) seen as ``t = W x + b`` (see ``analysis.consumers``):
    ``matrix(node, w)`` its float64 weight ``w`` as a ``Linear``, ``unfold`` / ``columns`` its input and
    output as (B, D | channels, positions), ``write(graph, node, w, b)`` the inverse of ``matrix``;
    ``bias_input`` the slot of its bias (None: none), ``axis`` the channel axis of its output;
    ``unfold_every(node, x, stride, first)`` (optional) ``unfold``'s every ``stride``-th position of the flattened
    b·L + l from ``first`` as (1, D, M), computed without unfolding the others; ``positions(node, shape)``
    (optional) how many positions L ``unfold`` gives a sample of an input of ``shape``."""

    matrix: Callable[[gs.Node, np.ndarray], Linear]
    unfold: Callable[[gs.Node, torch.Tensor], torch.Tensor]
    columns: Callable[[gs.Node, torch.Tensor], torch.Tensor]
    write: Callable[[gs.Graph, gs.Node, np.ndarray, np.ndarray], None]
    bias_input: int | None = 2
    axis: Callable[[gs.Node], int | None] = _channel_axis_one
    unfold_every: Callable[[gs.Node, torch.Tensor, int, int], torch.Tensor] | None = None
    positions: Callable[[gs.Node, tuple[int, ...]], int] | None = None


@dataclass(frozen=True)
class TorchLayer:
    """The torch layer a node of an op is exported from (what ``onnxprune.torch.apply_manifest`` slices): the
    parameter each float input after the data input holds, in order, and the module classes holding them (none: the
    layer cannot be sliced from the manifest)."""

    slots: tuple[str, ...]
    modules: tuple[type, ...] = ()


@dataclass(frozen=True)
class OpEntry:
    """What the tool knows of one op type; a missing field means it knows nothing of that aspect.

    ``channels``: the channel rule (``onnxprune.ops.roles``); none: blocked. ``macs(node, in_shape,
    out_shape)``: MACs per sample; none: 0. ``mixing``: the op mixes channels (a producer and consumer).
    ``resize(node, site, bounds, tag, graph)``: rewrite the node's channel bounds after a group was sliced (nodes
    it adds go into ``graph``).
    ``torch``: torch kernels keyed by the opset each starts at (ONNX's since_version); none: the torch
    evaluator refuses the op. ``static_inputs``: input slots never trained (shapes, scales, statistics).
    ``check(node, proto)``: why a node cannot be evaluated, or None. ``layer``: the torch layer it is exported from.
    """

    op_type: str
    channels: Rule | None = None
    macs: Callable[[gs.Node, Shape, Shape], int] | None = None
    mixing: Mixing | None = None
    resize: Callable[[gs.Node, ResizeSite, list[int], int, gs.Graph], None] | None = None
    torch: Mapping[int, OpFn] | None = None
    static_inputs: frozenset[int] = field(default_factory=frozenset)
    check: Callable[[OpNode, onnx.NodeProto], str | None] | None = None
    layer: TorchLayer | None = None

    def kernel(self, opset: int) -> OpFn | None:
        """The torch kernel for a model of ``opset``: the one starting at the largest version <= opset."""
        since = [v for v in (self.torch or {}) if v <= opset]
        return self.torch[max(since)] if since else None


ENTRIES: dict[str, OpEntry] = {}


def register(entry: OpEntry) -> OpEntry:
    """Add ``entry``; a second entry for an op type is a programming error."""
    old = ENTRIES.get(entry.op_type)
    if old is not None:
        raise ValueError(f"{entry.op_type} is already registered ({_describe(old)}): one entry per op type")
    ENTRIES[entry.op_type] = entry
    return entry


def _describe(entry: OpEntry) -> str:
    """The fields ``entry`` sets, functions by name."""
    def name(value: Any) -> str:
        if isinstance(value, Mapping):
            return "{" + ", ".join(f"{k}: {name(v)}" for k, v in value.items()) + "}"
        return getattr(value, "__qualname__", type(value).__name__)

    fields = ("channels", "macs", "mixing", "resize", "torch", "check")
    return ", ".join(f"{f}={name(getattr(entry, f))}" for f in fields if getattr(entry, f) is not None) or "empty"


@contextmanager
def registered(entry: OpEntry) -> Iterator[OpEntry]:
    """``entry`` registered for the ``with`` block only (tests, experiments)."""
    register(entry)
    try:
        yield entry
    finally:
        del ENTRIES[entry.op_type]


def lookup(op_type: str) -> OpEntry | None:
    return ENTRIES.get(op_type)


class Having:
    """The op types whose entry sets the field ``name``, as registered now: ``op in Having("macs")``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __contains__(self, op_type: str) -> bool:
        entry = ENTRIES.get(op_type)
        return entry is not None and getattr(entry, self.name) is not None


def product(dims: Sequence[int | None], node: gs.Node) -> int:
    """The product of a node's static ``dims`` (for MAC counts)."""
    if any(d is None for d in dims):
        raise ShapeError(f"{node.op} {node.name}: MACs need static shapes; export the model with a fixed input "
                         "size (only the batch dimension may be dynamic)")
    return int(np.prod(dims)) if dims else 1
