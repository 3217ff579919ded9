"""The samples ``recover`` trains on, the ones that pick checkpoints and the ones that judge the result; the
verdict's discrepancy."""

from __future__ import annotations

import numpy as np
import torch

from onnxprune.calib.sources import CalibrationSet
from onnxprune.errors import CalibrationError
from onnxprune.recovery.options import RecoverOptions
from onnxprune.recovery.train import kl_loss, relative_mse
from onnxprune.ir.store import Array, Store
from onnxprune.tasks import Detect


def _arrays(calib: CalibrationSet, batch_size: int, store: Store) -> dict[str, Array]:
    if len(calib) == 0:
        raise CalibrationError("the calibration set is empty: give a folder or file with samples")
    return store.stack(calib.batches(batch_size), len(calib))


def split(n: int, holdout: float, pair: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Every ⌈1/holdout⌉-th block of ``pair`` samples (an image and its mirror) is held out."""
    if not 0 < holdout < 1:
        raise CalibrationError(f"holdout must be between 0 and 1, got {holdout}")
    every = max(2, round(1 / holdout))
    block = np.arange(n) // pair
    held = block % every == every - 1
    if held.sum() < 2 * pair or (~held).sum() < 2:
        raise CalibrationError(f"{n} calibration samples are too few to hold out {holdout:.0%}: give at least "
                               f"{2 * every * pair} samples")
    return np.flatnonzero(~held), np.flatnonzero(held)


def halves(held: np.ndarray, pair: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The held-out samples that pick checkpoints and those that judge the result: alternate blocks of
    ``pair`` (an image and its mirror stay together)."""
    judge = np.arange(len(held)) // pair % 2 == 1
    return held[~judge], held[judge]


def samples(calib: CalibrationSet, held: CalibrationSet | None, options: RecoverOptions, store: Store
             ) -> tuple[dict[str, Array], np.ndarray, np.ndarray, np.ndarray]:
    """All samples (calibration, then the given held-out ones) and the train / checkpoint-picking /
    verdict indices."""
    values = _arrays(calib, options.batch_size, store)
    n = len(next(iter(values.values())))
    if held is None:
        pair = getattr(calib, "flip", False) + 1
        train, held_idx = split(n, options.holdout, pair)
        return values, train, *halves(held_idx, pair)
    extra = _arrays(held, options.batch_size, store)
    if set(extra) != set(values):
        raise CalibrationError(f"the held-out samples feed {sorted(extra)} but the calibration set {sorted(values)}")
    m = len(next(iter(extra.values())))
    pair = getattr(held, "flip", False) + 1
    if n < 2 or m < 2 * pair:
        raise CalibrationError(f"{n} calibration and {m} held-out samples: give at least 2 of each "
                               "(held-out: one half picks checkpoints, the other judges)")
    both = {k: store.concat([values[k], extra[k]]) for k in values}
    return both, np.arange(n), *halves(np.arange(n, n + m), pair)


def within(train: np.ndarray, fixed: int, fit: int, pair: int = 1, least: int = 1) -> np.ndarray:
    """The training samples to keep where at most ``fit`` samples in all fit the time for the passes over them, of
    which ``fixed`` (the held-out ones) stay: ``train`` evenly thinned, in whole blocks of ``pair`` (an image and its
    mirror), never below ``least`` blocks (one training batch); all of it where it fits."""
    blocks = len(train) // pair
    keep = max(least, 1, (fit - fixed) // pair)
    if keep >= blocks:
        return train
    chosen = np.unique(np.linspace(0, blocks - 1, keep).round().astype(int))
    return train.reshape(blocks, pair)[chosen].reshape(-1)


def discrepancy(student: list[np.ndarray], teacher: list[np.ndarray], task: Detect | None = None
                ) -> tuple[str, float, float | None]:
    """(metric, value, top-1 agreement), lower is better: for a detector (``task``), 1 − the mAP50-95 of the
    student's detections against the teacher's (where the teacher finds objects); a classifier's mean
    KL(teacher || student) of its 2-D first output's rows as probabilities; else Σ_k ||s_k - t_k||² /
    ||t_k - mean t_k||² over the outputs."""
    if task is not None:
        metric = task.metric()
        metric.update(student, teacher)
        found = metric.result().get("mAP50-95_ref")
        if found is not None:
            return "1-mAP50-95", 1.0 - found, None
    ys = [torch.from_numpy(a).double() for a in student]
    ts = [torch.from_numpy(a).double() for a in teacher]
    if teacher[0].ndim == 2:
        return "kl", float(kl_loss(ys, ts)), float((ys[0].argmax(1) == ts[0].argmax(1)).double().mean())
    return "rel_mse", float(relative_mse(ys, ts)), None
