"""MAC and parameter counts (the ops whose registry entry counts MACs: Conv, ConvTranspose, Gemm, MatMul,
the pruning papers' convention).

MACs are per sample (batch dimension excluded; a first axis that folds more rows a sample into it counts them
all). ``MacModel`` also gives the exact count after pruning for any choice of group widths, which the width
allocation uses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import const_shape, static_shape
from onnxprune.ir.shapes import folds_of, graph_batch
from onnxprune.analysis.groups import Group
from onnxprune.errors import ShapeError
from onnxprune.ops.registry import Having, lookup
from onnxprune.ir.subgraphs import bodies, nodes_within

MAC_OPS = Having("macs")  # the op types that count MACs (``op in MAC_OPS``)


@dataclass(frozen=True)
class MacEntry:
    """A MAC node and the groups whose widths scale it: ``(group id, share)`` of its input and of its
    output channels (share < 1 when the group holds a range of a concatenated or split tensor)."""

    node: str
    op: str
    macs: int
    inputs: tuple[tuple[int, float], ...]
    outputs: tuple[tuple[int, float], ...]

    @property
    def groups(self) -> set[int]:
        return {gid for gid, _ in (*self.inputs, *self.outputs)}


def _static(tensor: gs.Tensor) -> bool:
    """Whether ``tensor``'s shape is known past its batch axis."""
    shape = _batch_first(static_shape(tensor))
    return shape is not None and None not in shape[1:]


def _static_end(node: gs.Node) -> gs.Node:
    """The upstream node where static shapes end: its output's shape is unknown though its inputs' are known (a
    Loop, a data-dependent op, an op shape inference does not know)."""
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        parents = [t.inputs[0] for t in n.inputs if isinstance(t, gs.Variable) and not _static(t) and t.inputs]
        if not parents:
            return n
        stack.extend(parents)
    return node


def node_macs(node: gs.Node, batch: int | None = None) -> int:
    """MACs of one node for a single sample (0 for an op whose entry counts none); ShapeError naming where static
    shapes end when its shapes are not known. ``batch``: the graph's static batch, where it has one: a node whose
    first axis holds a multiple of it folds more than the samples there (a vision transformer's patches, a
    time-major sequence), which counts that many times (``_folds``)."""
    entry = lookup(node.op)
    if entry is None or entry.macs is None:
        return 0
    out = _batch_first(static_shape(node.outputs[0]))
    inp = _batch_first(static_shape(node.inputs[0]))
    try:
        if out is None or inp is None:
            raise ShapeError(node.name)
        return entry.macs(node, inp, out) * _folds(node.outputs[0], batch)
    except ShapeError:
        where = f"{node.op} {node.name}"
        stop = _static_end(node)
        if stop is node:
            raise ShapeError(f"{where}: unknown shapes; export the model with a fixed input size") from None
        domain = f" (domain {stop.domain})" if getattr(stop, "domain", None) else ""
        raise ShapeError(f"{where}: unknown shapes: static shapes end at {stop.op}{domain} {stop.name}; declare its "
                         "output shape as value_info in the model") from None


def _folds(out: gs.Tensor, batch: int | None) -> int:
    """How many of a single sample's rows a node's first axis holds: ``out[0] / batch`` where both are known and it
    divides (MobileViT's [4·N, 256, 64] patches at batch N), the k of a dynamic batch's ``N*k`` (``folded_symbol``),
    else 1."""
    first = out.shape[0] if out.shape else None
    if rows := folds_of(first):
        return rows
    if batch is None or not isinstance(first, (int, np.integer)) or first % batch:
        return 1
    return max(first // batch, 1)


def _batch_first(shape: list[int | None] | None) -> list[int | None] | None:
    """``shape`` with its batch axis first, as the MAC counts read it: the one dynamic dim when it is the only
    one, wherever it sits (a time-major ``[T, N, C]`` tensor, batch on axis 1, becomes ``[N, T, C]``)."""
    dynamic = [i for i, d in enumerate(shape or []) if d is None]
    if len(dynamic) != 1 or dynamic[0] == 0:
        return shape
    b = dynamic[0]
    return [None, *shape[:b], *shape[b + 1:]]


def uncounted(graph: gs.Graph) -> list[str]:
    """The control-flow nodes whose subgraphs hold MAC ops, which the counts leave out (their iterations are
    known only at run time), e.g. ``"Loop Loop.0 (10 MatMul)"``."""
    out = []
    for node in graph.nodes:
        ops = Counter(n.op for body in bodies(node) for n in nodes_within(body) if n.op in MAC_OPS)
        if ops:
            out.append(f"{node.op} {node.name} ({', '.join(f'{c} {op}' for op, c in ops.items())})")
    return out


_ONNX_FLOATS = {getattr(onnx.TensorProto, name) for name in ("BFLOAT16", "FLOAT8E4M3FN", "FLOAT8E4M3FNUZ",
                                                             "FLOAT8E5M2", "FLOAT8E5M2FNUZ", "FLOAT4E2M1")
                if hasattr(onnx.TensorProto, name)}


def _floating(dtype: np.dtype | int) -> bool:
    """Whether a constant's dtype is a float: a numpy dtype, or the ONNX type numpy has no name for (bfloat16,
    float8), as onnx-graphsurgeon gives it."""
    return dtype in _ONNX_FLOATS if isinstance(dtype, int) else np.issubdtype(np.dtype(dtype), np.floating)


def count_params(graph: gs.Graph) -> int:
    """Number of floating-point constant elements used by nodes (weights, biases, BN statistics); in a quantized
    model, the integer weights a DequantizeLinear reads count as the float ones they stand for, and the Q/DQ
    scales and zero points do not count."""
    seen: set[str] = set()
    total = 0
    for node in graph.nodes:
        for i, tensor in enumerate(node.inputs):
            if not isinstance(tensor, gs.Constant) or tensor.name in seen:
                continue
            seen.add(tensor.name)
            if node.op in ("QuantizeLinear", "DequantizeLinear") and i > 0:
                continue
            if _floating(tensor.dtype) or node.op == "DequantizeLinear":  # dtype and shape: values stay unloaded
                total += int(np.prod(const_shape(tensor), dtype=np.int64))
    return total


def _shares(tensor: gs.Tensor, groups: list[Group], member: dict[str, list[Group]]) -> tuple[tuple[int, float], ...]:
    """The share of ``tensor``'s channel entries that each group holds."""
    out = []
    for g in member.get(tensor.name, []):
        axis, repeat = g.tensors[tensor.name]
        dims = static_shape(tensor)
        size = dims[axis] if dims is not None and axis < len(dims) else None
        held = g.channels * repeat * len(g.offsets.get(tensor.name, [0]))
        out.append((g.id, held / size if size else 1.0))
    return tuple(out)


class MacModel:
    """Per-node MACs and which groups' widths scale each node's input and output channels.

    A node whose shapes are not known statically (after a Loop or a data-dependent op) counts 0 and is listed in
    ``unknown`` with the reason; a graph with no node of known MACs is refused (ShapeError)."""

    def __init__(self, graph: gs.Graph, groups: list[Group]) -> None:
        member: dict[str, list[Group]] = {}
        for g in groups:
            for name in g.tensors:
                member.setdefault(name, []).append(g)
        self.channels = {g.id: g.channels for g in groups}
        self.entries: list[MacEntry] = []
        self.unknown: list[str] = []  # "MatMul proj: unknown shapes: static shapes end at Loop decode"
        failures = []
        batch = graph_batch(graph)
        for node in graph.nodes:
            if node.op not in MAC_OPS:
                continue
            try:
                macs = node_macs(node, batch)
            except ShapeError as exc:
                macs = 0
                failures.append(exc)
                self.unknown.append(str(exc).split("; ")[0])
            self.entries.append(MacEntry(node.name, node.op, macs, _shares(node.inputs[0], groups, member),
                                         _shares(node.outputs[0], groups, member)))
        if failures and len(failures) == len(self.entries):
            raise failures[0]
        self._gids = [tuple(sorted(e.groups)) for e in self.entries]
        self._memo: dict[tuple, float] = {}

    @property
    def total(self) -> int:
        return sum(e.macs for e in self.entries)

    def macs(self, widths: dict[int, int]) -> float:
        """Exact MACs when group ``g`` keeps ``widths[g]`` channels (others unchanged)."""
        total = 0.0
        for i, gids in enumerate(self._gids):
            key = (i, *map(widths.get, gids))
            value = self._memo.get(key)
            if value is None:  # an allocation asks for the same entry at the same widths thousands of times
                value = self._memo[key] = self._entry_macs(self.entries[i], widths)
            total += value
        return total

    def _entry_macs(self, e: MacEntry, widths: dict[int, int]) -> float:
        scale = 1.0
        seen = {gid for gid, _ in e.inputs}  # a depthwise conv's input and output: one group, counted once
        for side in (e.inputs, tuple(o for o in e.outputs if o[0] not in seen)):
            scale *= 1.0 - sum(share * (1.0 - widths[gid] / self.channels[gid]) for gid, share in side
                               if gid in widths)
        return e.macs * scale
