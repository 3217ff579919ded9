"""What a strategy reads and does of a run: the ``Context`` protocol the pruning loop implements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.analysis import Analysis, consumers
from onnxprune.analysis.groups import ConsumerUse, Group
from onnxprune.imitation.gram import ConsumerStats
from onnxprune.ir.probe import FixedBatch
from onnxprune.ir.cuts import Liveness
from onnxprune.ir.store import Array

Progress = Callable[[int, int, str], None]
Choice = tuple[np.ndarray, np.ndarray, "float | None"]  # kept channels (sorted), fold factors, relative loss


@dataclass
class ConsumerData:
    """One consumer's streamed statistics (inputs on the pruned prefix, outputs of the original) and weights."""

    use: ConsumerUse
    folds: tuple[ConsumerStats, ConsumerStats]  # alternate batches, for choosing the refit's ridge
    stats: ConsumerStats  # both folds
    current: consumers.Linear
    original: consumers.Linear


class Settings(Protocol):
    """The plain knobs of a run that strategies read (``onnxprune.strategies.CompressOptions`` holds them)."""

    round_to: int  # widths are multiples of this
    curve_samples: int  # calibration samples of the local-imitation error curves
    batch_size: int  # samples per run and per statistics chunk
    provider: str  # onnxruntime's execution provider
    task: str  # how outputs are compared (``onnxprune.tasks``)


class Context(Protocol):
    """What the strategies read and do of a run (the pipeline's ``Compressor``): the graphs, the cached tensors at
    a cut, running the graph up to and past a cut, the consumers' statistics; a reconstruction writes ``graph``."""

    model: onnx.ModelProto  # as given
    original: gs.Graph  # the unpruned graph
    graph: gs.Graph  # the graph as pruned so far
    analysis: Analysis
    live: Liveness  # the original graph's node positions and live tensors
    inputs: dict[str, Array]  # the calibration samples
    values_p: dict[str, np.ndarray]  # the pruned prefix's cached tensors at the current cut
    options: Settings
    fixed_batch: FixedBatch | None  # the batch the graph fixes, if it does
    run_batch: int  # the batch the graph runs at
    stats_bytes: int  # a statistics chunk's unfolded inputs and targets hold at most this
    found: np.ndarray | None  # a detector's: whether the original finds an object on each calibration sample (None
    # where the run did not look)
    weights: np.ndarray | None  # a detector's position weights per calibration sample (``strategies.objects``)

    def advance(self, graph: gs.Graph, values: dict[str, np.ndarray], cut: int) -> None:
        """Bring the cached tensors ``values`` of ``graph`` to those live at ``cut`` (in place)."""

    def peek(self, graph: gs.Graph, values: dict[str, np.ndarray], names: set[str]) -> dict[str, np.ndarray]:
        """``values`` plus the tensors ``names`` not cached yet, computed ahead (not kept in the cache)."""

    def collect(self, group: Group, prefix: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                uses: list[ConsumerUse] | None = None, samples: np.ndarray | None = None) -> list[ConsumerData]:
        """Streamed statistics of the group's consumers (or ``uses``): inputs on ``prefix``, targets on the
        original network's tensors ``reference``; ``samples``: which calibration samples these tensors hold (None:
        all, in order), for a detector's position weights."""

    def note(self, group: Group, info: dict[str, Any]) -> None:
        """Record what the selector did on ``group`` (its layer report's ``selection``)."""

    def status(self, text: str) -> None:
        """Show what the selection of the current group is doing (progress)."""

    def generator(self, seed: int) -> np.random.Generator:
        """The run's generator of ``seed`` (one per seed, drawn on across groups)."""

    def reference_outputs(self) -> dict[str, np.ndarray]:
        """The original network's outputs on the calibration set."""
