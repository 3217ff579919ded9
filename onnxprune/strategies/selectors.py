"""Selectors that choose a group's channels from its consumers' statistics alone: OMP (the default), the paper's
local imitation, and the L1 and random baselines."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxprune.analysis.groups import Group
from onnxprune.core.context import Choice, ConsumerData, Context
from onnxprune.errors import OptionError
from onnxprune.imitation.local import greedy_local
from onnxprune.imitation.omp import SELECT_WORK, stats_omp
from onnxprune.imitation.gram import neuron_cross, neuron_gram, target_energy
from onnxprune.strategies.base import Selector


TARGETS = ("original", "paper")  # what Local imitates (--target)


@dataclass(frozen=True)
class OMP(Selector):
    """Group orthogonal matching pursuit: greedy forward selection on the refitted consumers' output error, several
    channels a step where the exact path would pass ``work`` multiply-adds (``omp.path_work``; inf: always exact)."""

    work: float = SELECT_WORK

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        path = stats_omp([d.stats for d in data], [d.current.k for d in data], width, work=self.work)
        keep = path.support(width)
        return keep, np.ones(width), float(path.curve[width] / max(path.curve[0], np.finfo(float).tiny))


@dataclass(frozen=True)
class Local(Selector):
    """The paper's greedy local imitation of ``imitate``: 'original' (the original network's layer output)
    or 'paper' (the layer's own output on the pruned prefix); ``--target`` on the command line."""

    imitate: str = "original"

    def __post_init__(self) -> None:
        if self.imitate not in TARGETS:
            raise OptionError(f"Local(imitate={self.imitate!r}): imitate is not one of {', '.join(TARGETS)}",
                              option="target")

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        n = group.channels
        G, c, tau = self.quadratic(group, data)
        path = greedy_local(G, c, tau, max_steps=3 * width)
        keep = path.support(width)
        a = path.weights(width)
        rel = float(path.curve[width] / tau) if tau > 0 and np.isfinite(path.curve[width]) else None
        return keep, n * a[keep], rel

    def quadratic(self, group: Group, data: list[ConsumerData]) -> tuple[np.ndarray, np.ndarray, float]:
        """(G, c, tau) of the local imitation loss aᵀGa - 2cᵀa + tau towards ``imitate``."""
        n = group.channels
        G = sum(neuron_gram(d.stats.xx, d.current.weight, d.current.k) for d in data)
        if self.imitate == "paper":
            return G, G.sum(axis=1) / n, float(G.sum()) / n**2
        c = sum(neuron_cross(d.stats.xt, d.stats.sx, d.current.weight, d.current.k, d.original.bias)
                for d in data) / n
        tau = sum(target_energy(d.stats.tt, d.stats.st, d.stats.count, d.original.bias) for d in data) / n**2
        return G, c, tau


@dataclass(frozen=True)
class L1(Selector):
    """Baseline: the channels of largest producer-weight L1 norm."""

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        n = group.channels
        norms = np.zeros(n)
        nodes = {node.name: node for node in ctx.graph.nodes}
        tensors = ctx.graph.tensors()
        for site in group.slices:
            if site.node in group.producers and site.input_index == 1:
                w = np.abs(np.asarray(nodes[site.node].inputs[1].values, dtype=np.float64))
                w = np.take(w, group.entries(tensors, site.tensor, site.offset, site.repeat), axis=site.axis)
                norms += np.moveaxis(w, site.axis, 0).reshape(n, -1).sum(axis=1)
        return np.sort(np.argsort(-norms, kind="stable")[:width]), np.ones(width), None


@dataclass(frozen=True)
class Random(Selector):
    """Baseline: channels drawn at random with ``seed``."""

    seed: int = 0

    def select(self, ctx: Context, group: Group, data: list[ConsumerData], width: int) -> Choice:
        return np.sort(ctx.generator(self.seed).choice(group.channels, width, replace=False)), np.ones(width), None
