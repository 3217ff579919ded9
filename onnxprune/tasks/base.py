"""What every task has: a metric accumulator and an objective; the raw objective (KL for logits, relative squared
error otherwise) that a task without one of its own uses."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from onnxprune.ir.ort import zero_pad
from onnxprune.tasks.boxes import Truth

Judge = Callable[[Sequence[Mapping[str, np.ndarray]]], float]  # candidates' outputs -> discrepancy to a fixed reference


class Metric:
    """Accumulates a task's scores batch by batch (``update``); ``result()`` names each score."""

    def update(self, ys: Sequence[np.ndarray], refs: Sequence[np.ndarray] | None,
               truths: Sequence[Truth] | None = None) -> None:
        raise NotImplementedError

    def result(self) -> dict[str, float | None]:
        raise NotImplementedError

    def spread(self) -> dict[str, float]:
        """How much the scores of ``result`` owe to which images were measured: for some scores (by name), the
        standard deviation over bootstrap resamples of the images; none by default."""
        return {}


@dataclass(frozen=True)
class Task:
    """A model's task: its name, and how its outputs are read."""

    name: str

    def metric(self) -> Metric | None:
        """The task's accumulator (None: the classifier's and the raw tensors' metrics are ``evaluate``'s own)."""
        return None

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        """The output discrepancy over chunks of samples (output name -> array): KL for a classifier's 2-D
        logits, the squared error's energy over the reference's for other outputs, summed over outputs."""
        return raw_discrepancy(reference, outputs)

    def judge(self, reference: Sequence[Mapping[str, np.ndarray]]) -> Judge:
        """``discrepancy`` against a fixed ``reference``, for many candidates' outputs (a task may read the
        reference once)."""
        return partial(self.discrepancy, reference)


def raw_discrepancy(reference: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Mapping[str, np.ndarray]]
                    ) -> float:
    """Summed over the float outputs of chunks of samples: the mean KL(reference || output) over the rows of a 2-D
    output with several columns (logits, or probabilities, see ``log_probs``), else the squared error's energy over
    the reference's."""
    kl, rows, err, energy = {}, {}, {}, {}
    for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
        for name, ref in ref_chunk.items():
            ref, y = ref.astype(np.float64), out_chunk[name].astype(np.float64)
            if ref.ndim == 2 and ref.shape[1] > 1:
                log_p, log_q = log_probs(ref), log_probs(y)
                kl[name] = kl.get(name, 0.0) + float(np.sum(np.exp(log_p) * (log_p - log_q)))
                rows[name] = rows.get(name, 0) + len(ref)
            else:
                ref, y = zero_pad(ref, y)  # a decoded sequence may be longer in one of them
                err[name] = err.get(name, 0.0) + float(np.sum(np.square(y - ref)))
                energy[name] = energy.get(name, 0.0) + float(np.sum(np.square(ref)))
    return sum(kl[k] / rows[k] for k in kl) + sum(err[k] / max(energy[k], 1e-30) for k in err)


def log_probs(x: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64: of the rows themselves when they are probabilities already
    (non-negative, summing to 1: a model that ends in Softmax), else their log-softmax (logits)."""
    x = x.astype(np.float64)
    if np.all(x >= 0) and np.allclose(x.sum(axis=1), 1.0, atol=1e-3):
        return np.log(np.maximum(x, 1e-12))
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
