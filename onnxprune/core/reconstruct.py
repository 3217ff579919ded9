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
from onnxprune.passes import refit_consumer, scale_columns


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
