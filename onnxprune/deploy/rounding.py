"""Weight rounding that minds the layer's output (GPTQ, Frantar et al. 2023): each quantized weight is rounded one
input column at a time, and the rounding error of a column is spread over the columns not rounded yet, through the
inverse of the Gram matrix ``H = Σ x xᵀ`` of the layer's inputs on the calibration samples, so that
``‖(W − Q) x‖²`` stays small rather than each ``|w − q|``. The per-channel scales the quantizer chose are kept:
only the integers of a QDQ model's weights change.

Pruned models need it most: their least-squares refits leave weights whose rows span wider ranges than the
original's, so a per-channel step is coarse for most of a row (MobileNetV2 245M, 7-bit weights alone: KL to the
original 0.091 → 0.127 rounded to nearest, 0.113 here; the notebook, "INT8 after pruning")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch
from onnx import helper, numpy_helper

from onnxprune.analysis import consumers
from onnxprune.ir.load import inferred_graph
from onnxprune.ir.ort import make_session

DAMP = 0.01  # of the Gram matrix's mean diagonal, added to it: rounding stays defined where inputs are collinear
COLUMNS = 1 << 22  # values of one sample's input columns at most, before its positions are thinned
WORK = 1 << 27  # multiply-adds of one sample's Gram product at most (MobileNetV2 at 224²: 65M), before thinning
INPUT_VALUES = 1 << 25  # input values of the samples the Gram matrices read, at most: 223 at 224², 27 at 640²
MIN_SAMPLES = 8
GRAM_BYTES = 1 << 30  # Gram matrices held at once (a run over the calibration samples each)


def gptq_round(weight: np.ndarray, gram: np.ndarray, scale: np.ndarray, qmax: int) -> np.ndarray:
    """The integers of ``weight`` (rows: output channels, columns: inputs) on the symmetric grid ``scale`` (one step
    per row, values within ±``qmax``), rounded column by column with each column's error moved onto the later ones
    by ``gram``'s inverse (``gram``: the inputs' Gram matrix, columns × columns)."""
    w = torch.from_numpy(np.asarray(weight, np.float64)).clone()
    h = torch.from_numpy(np.asarray(gram, np.float64)).clone()
    step = torch.from_numpy(np.asarray(scale, np.float64)).reshape(-1)
    step = torch.where(step > 0, step, torch.ones_like(step))
    dead = torch.diagonal(h) <= 0  # an input that is always zero: any value there is exact
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMP * torch.diagonal(h).mean() * torch.eye(len(h), dtype=h.dtype)
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for j in range(w.shape[1]):
        q[:, j] = torch.clamp(torch.round(w[:, j] / step), -qmax, qmax)
        error = (w[:, j] - q[:, j] * step) / upper[j, j]
        w[:, j + 1:] -= error[:, None] * upper[j, j + 1:][None, :]
    return q.numpy()


def _stride(node: gs.Node, shape: tuple[int, ...], groups: int) -> int:
    """Every how many of a sample's positions ``input_grams`` reads for ``node`` (input ``shape``): all of them
    unless its columns would hold more than ``COLUMNS`` values or their product cost more than ``WORK``."""
    _, columns, positions = consumers.unfold(node, torch.empty((1, *shape[1:]), device="meta")).shape
    d = columns // groups
    return max(1, d * positions // COLUMNS, groups * d * d * positions // WORK)


def input_grams(model: onnx.ModelProto, nodes: list[onnx.NodeProto], feeds: Iterable[dict[str, np.ndarray]]
                ) -> dict[str, np.ndarray]:
    """For each of ``nodes`` (Conv, Gemm, MatMul of ``model``), the Gram matrices of the columns it multiplies its
    weight by (``analysis.consumers.unfold``) over the first ``feeds`` (their samples' inputs holding at most
    ``INPUT_VALUES`` values, ``MIN_SAMPLES`` samples at least), one per conv group: {node name: (groups, d, d)},
    summed a sample at a time, on every ``_stride``-th position (a 3×3 conv of 512 channels at 20²: every 63rd)."""
    names = sorted({n.input[0] for n in nodes})
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                              for name in names if name not in declared)
    session, _ = make_session(probe, "cpu", quiet=True)
    graph_nodes = {n.name: n for n in inferred_graph(model).nodes}
    grams: dict[str, torch.Tensor] = {}
    strides: dict[str, int] = {}
    seen, limit = 0, None
    for feed in feeds:
        if limit is None:
            per_sample = sum(a[0].size for a in feed.values() if a.ndim)
            limit = max(MIN_SAMPLES, INPUT_VALUES // max(per_sample, 1))
        if seen >= limit:
            break
        values = dict(zip(names, session.run(names, feed)))
        take = min(limit - seen, len(next(iter(feed.values()))))
        seen += take
        for name in (n.name for n in nodes):
            node = graph_nodes[name]
            groups = int(node.attrs.get("group", 1))
            for sample in values[node.inputs[0].name][:take]:
                x = torch.from_numpy(sample[None].astype(np.float64))
                stride = strides.setdefault(name, _stride(node, tuple(x.shape), groups))
                cols = consumers.unfold_every(node, x, stride, 0)
                cols = cols.reshape(groups, cols.shape[1] // groups, -1)
                gram = torch.bmm(cols, cols.transpose(1, 2))
                grams[name] = grams[name] + gram if name in grams else gram
    return {name: g.numpy() for name, g in grams.items()}


@dataclass(frozen=True)
class _Plan:
    """A weighted node of the QDQ model whose int8 weight ``gptq_weights`` re-rounds: its DequantizeLinear, the
    integers, the per-channel scales (along ``axis``) and the node's conv groups."""

    node: onnx.NodeProto
    dq: onnx.NodeProto
    ints: np.ndarray
    scale: np.ndarray
    axis: int
    groups: int

    @property
    def gram_bytes(self) -> int:
        """What its Gram matrices hold: one of its row's columns squared per conv group, in float64."""
        return 8 * self.groups * (self.ints.size // self.ints.shape[self.axis]) ** 2


def _batches(plans: list[_Plan], grams_bytes: int) -> list[list[_Plan]]:
    """``plans`` in runs whose Gram matrices together hold at most ``grams_bytes`` (one at least)."""
    runs: list[list[_Plan]] = [[]]
    held = 0
    for plan in plans:
        if runs[-1] and held + plan.gram_bytes > grams_bytes:
            runs.append([])
            held = 0
        runs[-1].append(plan)
        held += plan.gram_bytes
    return runs


def gptq_weights(qdq: onnx.ModelProto, model: onnx.ModelProto, feeds: Callable[[], Iterable[dict[str, np.ndarray]]]
                 ) -> None:
    """Re-round, in place, the int8 weights of the QDQ model ``qdq`` of the float ``model`` (nodes named alike) with
    ``gptq_round`` on the Gram matrices of ``model``'s inputs over ``feeds()``, on the scales and within the range
    ``qdq`` holds: the weights that are a per-channel DequantizeLinear of int8 (``_readable``)."""
    inits = {t.name: t for t in qdq.graph.initializer}
    floats = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in qdq.graph.node for o in n.output}
    float_nodes = {n.name: n for n in model.graph.node}
    plans = []
    for node in qdq.graph.node:
        dq = producer.get(node.input[1]) if node.op_type in ("Conv", "Gemm", "MatMul") and len(node.input) > 1 else None
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in inits or node.name not in float_nodes:
            continue
        ints = numpy_helper.to_array(inits[dq.input[0]])
        scale = numpy_helper.to_array(inits[dq.input[1]])
        if ints.dtype != np.int8 or scale.ndim != 1 or not _readable(node, ints.ndim):
            continue
        axis = next((helper.get_attribute_value(a) for a in dq.attribute if a.name == "axis"), 1) % ints.ndim
        groups = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "group"), 1)
        plans.append(_Plan(node, dq, ints, scale, axis, groups))
    for run in _batches(plans, GRAM_BYTES):
        grams = input_grams(model, [float_nodes[plan.node.name] for plan in run], feeds())
        for plan in run:
            weight = numpy_helper.to_array(floats[float_nodes[plan.node.name].input[1]]).astype(np.float64)
            rows = np.moveaxis(weight, plan.axis, 0)
            per = rows.reshape(plan.groups, len(rows) // plan.groups, -1)
            steps = plan.scale.reshape(plan.groups, -1)
            qmax = int(np.abs(plan.ints).max())  # the range the quantizer used: the largest weight of a row lands on it
            q = np.concatenate([gptq_round(per[g], grams[plan.node.name][g], steps[g], qmax)
                                for g in range(plan.groups)])
            q = np.moveaxis(q.reshape(np.moveaxis(plan.ints, plan.axis, 0).shape), 0, plan.axis)
            inits[plan.dq.input[0]].CopyFrom(numpy_helper.from_array(q.astype(np.int8), plan.dq.input[0]))


def _readable(node: onnx.NodeProto, rank: int) -> bool:
    """Whether ``input_grams`` reads ``node``'s inputs: a Gemm without transA or a MatMul of a matrix, a 2-D Conv with
    explicit pads (another keeps its nearest rounding)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        return rank == 4 and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
    return rank == 2 and not attrs.get("transA", 0)
