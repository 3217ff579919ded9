"""How sure ``recover``'s never-worse verdict is: on a few held-out samples a better score can be luck.

The verdict samples are resampled with replacement (a bootstrap) and each resample scored for the input model and
for the recovered weights, by the verdict's own metric; ``recover`` reports the share of resamples on which the
recovered weights score better. It does not decide by it, measured: nudenet's YOLOv8n 320 at 0.70×, head-distilled
on 47 photos with objects, scored 1 − mAP50-95 0.078 → 0.037 on its 5 verdict photos (better on 80% of their
resamples) and 0.173 → 0.218 on 59 photos it never saw (better on 0.6% of theirs); MobileNetV2 245M, recovered for
15 minutes, scored KL 0.114 → 0.090 on its 50 verdict photos, better on 90% of their resamples (84% in another run),
and gains on 100 unseen photos (top-1 79% → 81%, KL 0.115 → 0.072; the notebook's "How sure the verdict is"). A
threshold between the two would rest on little.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from onnxprune.recovery.objective import DetectLoss
from onnxprune.recovery.train import row_kl
from onnxprune.tasks import Detect
from onnxprune.tasks.boxes import APAccumulator

RESAMPLES = 1000

Scores = Callable[[np.ndarray], float | None]  # a model's verdict metric (lower is better) on a resample's indices


def scores(metric: str, outputs: list[np.ndarray], teacher: list[np.ndarray], task: Detect | None) -> Scores:
    """``outputs``' discrepancy to ``teacher`` by ``metric`` (``samples.discrepancy``'s, or "objective": a tied
    detector's training objective) on any resample of the samples (the first axis, as the verdict reads it), from
    per-sample parts computed once."""
    n = len(teacher[0])
    if metric == "1-mAP50-95":
        parts = _image_aps(task, outputs, teacher)

        def on_map(pick: np.ndarray) -> float | None:
            found = APAccumulator.pooled([parts[i] for i in pick]).result()["mAP50-95"]
            return None if found is None else 1.0 - found
        return on_map
    ys = [torch.from_numpy(a).double() for a in outputs]
    ts = [torch.from_numpy(a).double() for a in teacher]
    if metric == "objective":
        loss = DetectLoss(task.layout)
        sums = np.array([[float(s) for s in loss.sums([y[i : i + 1] for y in ys], [t[i : i + 1] for t in ts])]
                         for i in range(n)])
        return lambda pick: float(loss.combine([torch.tensor(s) for s in sums[pick].sum(0)]))
    if metric == "kl":
        kl = row_kl(ys[0], ts[0]).numpy()
        return lambda pick: float(kl[pick].mean())
    # relative squared error: each output's per-sample error over its energy on all the samples
    err = sum(((y - t) ** 2).flatten(1).sum(1).numpy() / max(float(((t - t.mean(0)) ** 2).sum()), 1e-12) * n
              for y, t in zip(ys, ts))
    return lambda pick: float(err[pick].mean())


def _image_aps(task: Detect, outputs: list[np.ndarray], teacher: list[np.ndarray]) -> list[APAccumulator]:
    """Each sample's detections matched to the teacher's, one accumulator a sample."""
    metric = task.metric()
    metric.update(outputs, teacher)
    return metric.images


def confidence(before: Scores, after: Scores, n: int, seed: int) -> float:
    """The share of ``RESAMPLES`` bootstrap resamples of the ``n`` samples on which ``after`` scores below
    ``before`` (a resample neither can be scored on counts against)."""
    gen, wins = np.random.default_rng(seed), 0
    for _ in range(RESAMPLES):
        pick = gen.integers(0, n, n)
        b, a = before(pick), after(pick)
        wins += b is not None and a is not None and a < b
    return wins / RESAMPLES
