"""Consumers' weights written into a graph from their statistics: the least-squares refit and the per-channel
scale, with the output error each leaves (what ``Reconstruction`` strategies and the loop's later refits use)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis import consumers
from onnxprune.analysis.groups import Group
from onnxprune.core.context import ConsumerData
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import quadratic_loss_full, refit_cv
from onnxprune.ir.graph import const_value
from onnxprune.ops.registry import bias_of, set_bias
from onnxprune.passes import refit_consumer, scale_columns
from onnxprune.ir.store import Array


def refit(graph: gs.Graph, group: Group, data: list[ConsumerData], cols: np.ndarray, priors: list[np.ndarray]
          ) -> tuple[gs.Graph, list[float], float]:
    """Least-squares refit of each consumer from its statistics' channels ``cols`` towards ``priors`` (ridge by
    cross-validation), written into ``graph``. Returns the graph, the ridges and the summed output error."""
    ridges = []
    for d, prior in zip(data, priors):
        w, b, ridge = refit_cv(d.folds, expand(cols, d.current.k), prior=prior, merged=d.stats)
        ridges.append(ridge)
        graph = refit_consumer(graph, d.use.node, consumers.Linear(w, b, d.current.k), group, d.use)
    return graph, ridges, written_error(graph, group, data, cols)


def written_error(graph: gs.Graph, group: Group, data: list[ConsumerData], cols: np.ndarray) -> float:
    """The consumers' summed output error with the weights ``graph`` holds, on their statistics' channels ``cols``."""
    return sum(quadratic_loss_full(d.stats, expand(cols, d.current.k), *_weights_in(graph, group, d)) for d in data)


def scale(graph: gs.Graph, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
          ) -> tuple[gs.Graph, float]:
    """The kept channels' consumer columns scaled by ``fold`` in ``graph``; returns it and the consumers' summed
    output error."""
    return scale_columns(graph, group, fold), sum(fold_loss(d, keep, fold) for d in data)


def fold_loss(d: ConsumerData, keep: np.ndarray, fold: np.ndarray) -> float:
    """Output error of the consumer with its kept columns scaled by ``fold`` and its bias unchanged."""
    k = d.current.k
    w = d.current.weight[:, expand(keep, k)] * np.repeat(fold, k)[None, :]
    return quadratic_loss_full(d.stats, expand(keep, k), w, d.current.bias)


def _weights_in(graph: gs.Graph, group: Group, d: ConsumerData) -> tuple[np.ndarray, np.ndarray]:
    node = next(n for n in graph.nodes if n.name == d.use.node)
    lin = consumers.group_view(graph, node, group, d.use).linear(consumers.matrix(node))
    return lin.weight, lin.bias


GateShift = tuple[np.ndarray, np.ndarray]  # (what each output lost on average, the output rows kept)


def gate_shifts(graph: gs.Graph, group: Group, entries: dict[str, np.ndarray],
                values: dict[str, Array]) -> dict[str, GateShift]:
    """For each 1×1 gate conv of ``group`` (``Group.gates``; VoVNet's effective squeeze-excitation), before the group
    is sliced to what it keeps (``entries``: ``kept_entries``): what the input channels it is about to lose added to
    each of its outputs, on average over the calibration samples of its input in ``values`` (``W[:, dropped] · mean
    x[dropped]``), and the output rows that stay. ``shift_gates`` moves it into the bias once sliced, so the kept
    channels' gates keep their mean."""
    nodes = {n.name: n for n in graph.nodes}
    out = {}
    for name in group.gates:
        gate = nodes.get(name)
        weight = None if gate is None else const_value(gate.inputs[1])
        x = None if gate is None else gate.inputs[0].name
        if weight is None or weight.ndim != 4 or weight.shape[2:] != (1, 1) or x not in entries or x not in values:
            continue
        total, count = np.zeros(weight.shape[1]), 0
        for start in range(0, len(values[x]), 64):  # a spilled array is read by ranges of samples
            rows = np.asarray(values[x][start:start + 64], np.float64)
            total += rows.sum(axis=tuple(i for i in range(rows.ndim) if i != 1))
            count += rows.size // rows.shape[1]
        dropped = np.setdiff1d(np.arange(weight.shape[1]), entries[x])
        shift = weight[:, dropped, 0, 0].astype(np.float64) @ (total[dropped] / max(count, 1))
        out[name] = (shift, entries.get(gate.outputs[0].name, np.arange(weight.shape[0])))
    return out


def shift_gates(graph: gs.Graph, shifts: dict[str, GateShift]) -> None:
    """Add each gate's shift (``gate_shifts``), at its kept rows, to its bias (written where it had none)."""
    nodes = {n.name: n for n in graph.nodes}
    for name, (shift, rows) in shifts.items():
        gate = nodes[name]
        weight = np.asarray(gate.inputs[1].values)
        set_bias(gate, (bias_of(gate, weight.shape[0]) + shift[rows]).astype(weight.dtype))
