"""Attention decoders' per-step class scores: token sequences up to their end token against the reference's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxprune.ir.ort import zero_pad
from onnxprune.tasks.base import Metric, Task
from onnxprune.tasks.ctc import CTCMetric


@dataclass(frozen=True)
class Seq(Task):
    """An attention decoder's per-step class scores ``[N, L, C]``, L varying with the input (a table-structure or
    formula recogniser): its argmax token sequences, each up to its end token (the last class, as PaddleOCR's
    attention heads write it), against the reference's (exact and per token). Named with ``--task seq``: its
    layout is a CTC recogniser's."""

    output: int = 0

    def metric(self) -> Metric:
        return SeqMetric(self)

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        """The squared error of every output over the reference's energy, on the steps up to the end of each of
        the reference's sequences (what a decoder runs past the end is padding), summed over the outputs."""
        err: dict[str, float] = {}
        energy: dict[str, float] = {}
        for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
            scores = list(ref_chunk.values())[self.output]
            steps = _until_end(scores)
            for name, ref in ref_chunk.items():
                ref, y = zero_pad(ref.astype(np.float64), out_chunk[name].astype(np.float64))
                mask = np.zeros(ref.shape[:2], bool)
                if ref.ndim >= 2 and ref.shape[0] == steps.shape[0]:
                    mask[:, : steps.shape[1]] = steps[:, : ref.shape[1]]
                else:
                    mask[:] = True
                err[name] = err.get(name, 0.0) + float(np.sum(np.square(y - ref)[mask]))
                energy[name] = energy.get(name, 0.0) + float(np.sum(np.square(ref)[mask]))
        return sum(err[k] / max(energy[k], 1e-30) for k in err)


def _until_end(scores: np.ndarray) -> np.ndarray:
    """``[N, L]``: True on each sequence's steps up to and including its first end token (the last class)."""
    ended = np.cumsum(scores.argmax(axis=-1) == scores.shape[-1] - 1, axis=1)
    return (ended == 0) | ((ended == 1) & (np.diff(ended, axis=1, prepend=0) == 1))


class SeqMetric(CTCMetric):
    def strings(self, ys: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
        y = ys[self.task.output]
        return [tuple(int(t) for t in row[keep]) for row, keep in zip(y.argmax(axis=-1), _until_end(y))]

    def result(self) -> dict[str, float | None]:
        if not self.total:
            return {}
        return {"sequence_agreement_ref": self.same / self.total,
                "token_agreement_ref": 1.0 - self.edits / max(self.chars, 1)}
