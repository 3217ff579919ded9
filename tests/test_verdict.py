"""How sure recover's verdict is: resampled scores, and the share of resamples a gain holds on (no graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxprune.recovery import discrepancy
from onnxprune.recovery.objective import DetectLoss, detect_task
from onnxprune.recovery.verdict import confidence, scores
from tests.test_recovery import _yolo


def test_resampled_scores_on_every_sample_once_are_the_verdicts_own() -> None:
    """Scored on each sample once, the per-sample parts give the verdict's value: a classifier's KL, raw outputs'
    relative squared error (two outputs), a detector's 1 − mAP50-95 (images pooled) and its training objective."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (9, 5))
    raw = [rng.normal(0, 1, (9, 2, 3, 3)), rng.normal(5, 1, (9, 4))]
    teacher = _yolo(rng, 9)
    student = teacher.copy()
    student[:, :4] += rng.normal(0, 2, student[:, :4].shape)
    student[:, 4:] += rng.uniform(0, 0.3, student[:, 4:].shape)
    task = detect_task([teacher], [np.zeros((1, 3, 64, 64), np.float32)])
    every = np.arange(9)
    for metric, ys, ts, t in (("kl", [logits + rng.normal(0, 0.3, logits.shape)], [logits], None),
                              ("rel_mse", [r + rng.normal(0, 0.2, r.shape) for r in raw], raw, None),
                              ("1-mAP50-95", [student], [teacher], task)):
        name, value, _ = discrepancy(ys, ts, t)
        assert name == metric and 0 < value
        assert scores(metric, ys, ts, t)(every) == pytest.approx(value, rel=1e-9)
    loss = float(DetectLoss(task.layout)([torch.from_numpy(student)], [torch.from_numpy(teacher)]))
    assert scores("objective", [student], [teacher], task)(every) == pytest.approx(loss, rel=1e-9)
    # a resample that repeats a sample counts it twice
    twice = scores("kl", [logits * 0.5], [logits], None)
    assert twice(np.array([0, 0, 1])) == pytest.approx((2 * twice(np.array([0])) + twice(np.array([1]))) / 3)


def test_a_gain_made_on_one_sample_of_five_holds_on_the_resamples_that_draw_it() -> None:
    """After lower on every sample: better on every resample. After lower on the mean only through one sample of five
    (a little worse on the other four): better on the resamples that draw it, about 1 − 0.8⁵ = 67% of them."""
    rng = np.random.default_rng(1)
    t = rng.normal(0, 1, (5, 4))
    near, far = t + 0.1, t + rng.normal(0, 1, t.shape)
    assert confidence(scores("kl", [far], [t], None), scores("kl", [near], [t], None), 5, seed=0) == 1.0
    lucky = far.copy()
    lucky[0] = t[0]
    lucky[1:] = far[1:] + 0.05 * rng.normal(0, 1, far[1:].shape)
    before, after = scores("kl", [far], [t], None), scores("kl", [lucky], [t], None)
    assert after(np.arange(5)) < before(np.arange(5))
    share = confidence(before, after, 5, seed=0)
    assert abs(share - (1 - 0.8**5)) < 0.05
