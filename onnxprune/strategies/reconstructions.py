"""Reconstructions: how the consumers' weights are set once a group's channels are chosen."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxprune.analysis.groups import Group
from onnxprune.core import reconstruct
from onnxprune.core.context import ConsumerData, Context
from onnxprune.errors import OptionError
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import refit_scale
from onnxprune.imitation.gram import neuron_cross, neuron_gram
from onnxprune.strategies.base import Reconstruction


@dataclass(frozen=True)
class NoRefit(Reconstruction):
    """Keep the consumers' weights, folding the selector's per-channel factors (the paper's N·a_i)."""

    def apply(self, ctx: Context, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
              ) -> tuple[float, list[float]]:
        ctx.graph, err = reconstruct.scale(ctx.graph, group, data, keep, fold)
        return err, []


@dataclass(frozen=True)
class Scale(Reconstruction):
    """A least-squares scale per kept channel, with relative ``ridge``."""

    ridge: float = 1e-4

    def __post_init__(self) -> None:
        if not self.ridge >= 0:
            raise OptionError(f"Scale(ridge={self.ridge}): the ridge must be at least 0")

    def apply(self, ctx: Context, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
              ) -> tuple[float, list[float]]:
        G = sum(neuron_gram(d.stats.xx, d.current.weight, d.current.k) for d in data)[np.ix_(keep, keep)]
        c = sum(neuron_cross(d.stats.xt, d.stats.sx, d.current.weight, d.current.k, d.original.bias)
                for d in data)[keep]
        ctx.graph, err = reconstruct.scale(ctx.graph, group, data, keep, refit_scale(G, c, ridge=self.ridge))
        return err, []


@dataclass(frozen=True)
class Refit(Reconstruction):
    """A full least-squares refit of every consumer, its ridge chosen by cross-validation."""

    refits_after_gate = True

    def apply(self, ctx: Context, group: Group, data: list[ConsumerData], keep: np.ndarray, fold: np.ndarray
              ) -> tuple[float, list[float]]:
        ctx.graph, ridges, err = reconstruct.refit(ctx.graph, group, data, keep,
                                                   [d.current.weight[:, expand(keep, d.current.k)] for d in data])
        return err, ridges
