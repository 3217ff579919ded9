"""Weight rounding that minds the layer's output (GPTQ, Frantar et al. 2023): each quantized weight is rounded one
input column at a time, and the rounding error of a column is spread over the columns not rounded yet, through the
inverse of the Gram matrix ``H = Σ x xᵀ`` of the layer's inputs on the calibration samples, so that ``‖(W − Q) x‖²``
stays small rather than each ``|w − q|``. The per-channel scales the quantizer chose are kept: only the integers of a
QDQ model's weights change.

Pruned models need it most: their least-squares refits leave weights whose rows span wider ranges than the
original's, so a per-channel step is coarse for most of a row (MobileNetV2 245M, 7-bit weights alone: KL to the
original 0.091 → 0.127 rounded to nearest, 0.113 here; the notebook, "INT8 after pruning")."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from onnxprune.ir.ort import make_session

DAMP = 0.01  # of the Gram matrix's mean diagonal, added to it: rounding stays defined where inputs are collinear
COLUMNS = 1 << 22  # values of one sample's input columns at most, before positions are thinned
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


def _columns(node: onnx.NodeProto, x: torch.Tensor, kernel: list[int]) -> torch.Tensor:
    """What the weighted ``node`` (a Conv of ``kernel``) multiplies its weight by, per conv group: (groups, inputs per
    group, positions)."""
    if node.op_type != "Conv":
        return x.reshape(-1, x.shape[-1]).T[None] if node.op_type == "MatMul" else x.reshape(len(x), -1).T[None]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    dims = len(kernel)
    pads = list(attrs.get("pads", [0] * 2 * dims))
    x = F.pad(x, (pads[1], pads[3], pads[0], pads[2]))
    cols = F.unfold(x, kernel, dilation=list(attrs.get("dilations", [1, 1])), stride=list(attrs.get("strides", [1, 1])))
    groups = int(attrs.get("group", 1))
    b, d, positions = cols.shape
    return cols.reshape(b, groups, d // groups, positions).permute(1, 2, 0, 3).reshape(groups, d // groups, -1)


def input_grams(model: onnx.ModelProto, nodes: list[onnx.NodeProto], feeds: Iterable[dict[str, np.ndarray]]
                ) -> dict[str, np.ndarray]:
    """For each of ``nodes`` (Conv, Gemm, MatMul of ``model``), the Gram matrices of its input columns over the
    first ``feeds`` (their samples' inputs holding at most ``INPUT_VALUES`` values, ``MIN_SAMPLES`` samples at least),
    one per conv group: {node name: (groups, d, d)}, summed a sample at a time, on every ``k``-th position
    where a sample's columns would hold more than ``COLUMNS`` values or its product cost more than ``WORK``
    multiply-adds (a 3×3 conv of 512 channels at 20²: every 63rd position)."""
    names = sorted({n.input[0] for n in nodes})
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {o.name for o in probe.graph.output}
    probe.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                              for name in names if name not in declared)
    session, _ = make_session(probe, "cpu", quiet=True)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    grams: dict[str, torch.Tensor] = {}
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
        for node in nodes:
            for sample in values[node.input[0]][:take]:
                cols = _columns(node, torch.from_numpy(sample[None].astype(np.float64)), dims[node.input[1]][2:])
                groups, d, positions = cols.shape
                cols = cols[:, :, ::max(1, d * positions // COLUMNS, groups * d * d * positions // WORK)]
                gram = torch.bmm(cols, cols.transpose(1, 2))
                grams[node.name] = grams[node.name] + gram if node.name in grams else gram
    return {name: g.numpy() for name, g in grams.items()}


def _batches(plans: list[tuple], grams_bytes: int) -> list[list[tuple]]:
    """``plans`` in runs whose Gram matrices together hold at most ``grams_bytes`` (one at least)."""
    runs: list[list[tuple]] = [[]]
    held = 0
    for plan in plans:
        ints, axis, groups = plan[2], plan[4], plan[5]
        size = 8 * groups * (ints.size // ints.shape[axis]) ** 2
        if runs[-1] and held + size > grams_bytes:
            runs.append([])
            held = 0
        runs[-1].append(plan)
        held += size
    return runs


def gptq_weights(qdq: onnx.ModelProto, model: onnx.ModelProto, feeds: Callable[[], Iterable[dict[str, np.ndarray]]]
                 ) -> list[str]:
    """Re-round, in place, the int8 weights of the QDQ model ``qdq`` of the float ``model`` (nodes named alike) with
    ``gptq_round`` on the Gram matrices of ``model``'s inputs over ``feeds()``, on the scales and within the range
    ``qdq`` holds. Returns the nodes re-rounded: those whose weight is a per-channel DequantizeLinear of int8."""
    inits = {t.name: t for t in qdq.graph.initializer}
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
        plans.append((node, dq, ints, scale, axis, groups))
    for run in _batches(plans, GRAM_BYTES):
        grams = input_grams(model, [float_nodes[plan[0].name] for plan in run], feeds())
        for node, dq, ints, scale, axis, groups in run:
            rows = np.moveaxis(_float_weight(model, float_nodes[node.name]).astype(np.float64), axis, 0)
            per, steps = rows.reshape(groups, len(rows) // groups, -1), scale.reshape(groups, -1)
            qmax = int(np.abs(ints).max())  # the range the quantizer used: the largest weight of a row lands on it
            q = np.concatenate([gptq_round(per[g], grams[node.name][g], steps[g], qmax) for g in range(groups)])
            q = np.moveaxis(q.reshape(np.moveaxis(ints, axis, 0).shape), 0, axis)
            inits[dq.input[0]].CopyFrom(numpy_helper.from_array(q.astype(np.int8), dq.input[0]))
    return [plan[0].name for plan in plans]


def _readable(node: onnx.NodeProto, rank: int) -> bool:
    """Whether ``_columns`` reads ``node``'s inputs: a Gemm without transA or a MatMul of a matrix, a 2-D Conv with
    explicit pads (another keeps its nearest rounding)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        return rank == 4 and attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
    return rank == 2 and not attrs.get("transA", 0)


def _float_weight(model: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """The constant weight of ``node`` in the float ``model``, as the QDQ model's DequantizeLinear lays it out."""
    weight = next(t for t in model.graph.initializer if t.name == node.input[1])
    return numpy_helper.to_array(weight)
