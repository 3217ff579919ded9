"""What recovery trains towards and judges by: the task ``eval`` reports, where the outputs show one.

A detector (any ``tasks.boxes`` layout: YOLOv5/v8/v11, YOLOX with or without its grid decoded, PicoDet/GFL
distance bins, dense face heads) trains on ``DetectLoss``, the objective ``compress`` allocates by, on the boxes
``DetectionLayout.decoded`` places (the code ``eval`` decodes with), and is judged by its mAP50-95 against the
teacher's detections; a classifier on the KL; anything else on the relative squared error of
its raw outputs."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from onnxprune.recovery.train import Loss, kl_loss, relative_mse
from onnxprune.tasks import Detect, image_hw, infer_task
from onnxprune.tasks.detect import BOX_WEIGHT_FLOOR
from onnxprune.tasks.boxes import DetectionLayout


@dataclass(frozen=True)
class DetectLoss:
    """``tasks.Detect``'s objective on torch tensors: the class scores' squared error over the teacher's energy on
    every anchor, plus the boxes' absolute error (the four edges) in units of each teacher box's size, weighted by
    the teacher's best score where it is at least ``BOX_WEIGHT_FLOOR`` (an object), over the weights. ``sums`` are
    additive over batches (``train.held_loss`` accumulates them), ``combine`` turns them into the loss."""

    layout: DetectionLayout

    def sums(self, ys: list[torch.Tensor], ts: list[torch.Tensor]) -> list[torch.Tensor]:
        yb, ysc, _ = self.layout.decoded(ys)
        tb, tsc, _ = self.layout.decoded(ts)
        w = tsc.max(dim=-1).values
        w = torch.where(w >= BOX_WEIGHT_FLOOR, w, torch.zeros_like(w))
        size = torch.maximum(tb[..., 2] - tb[..., 0], tb[..., 3] - tb[..., 1]).clamp_min(1.0)
        box = ((yb - tb).abs() / size[..., None]).sum(dim=-1)
        return [((ysc - tsc) ** 2).sum(), (tsc**2).sum(), (w * box).sum(), w.sum()]

    @staticmethod
    def combine(sums: list[torch.Tensor]) -> torch.Tensor:
        return sums[0] / sums[1].clamp_min(1e-30) + sums[2] / sums[3].clamp_min(1e-30)

    def __call__(self, ys: list[torch.Tensor], ts: list[torch.Tensor]) -> torch.Tensor:
        return self.combine(self.sums(ys, ts))


def detect_task(teacher: list[np.ndarray], inputs: list[np.ndarray]) -> Detect | None:
    """The detector the teacher's outputs show (any ``DetectionLayout``: decoded in the graph or not), else None."""
    hw = image_hw(inputs[0]) if len(inputs) == 1 else None
    if hw is None or teacher[0].ndim != 3:
        return None
    task = infer_task(teacher, hw, len(teacher[0]))
    layout = getattr(task, "layout", None)
    if type(task) is not Detect or not isinstance(layout, DetectionLayout):
        return None
    return task


def objective(teacher: list[np.ndarray], task: Detect | None) -> Loss:
    """The training loss towards the teacher's outputs: ``DetectLoss`` for ``task``, KL for a classifier's 2-D output,
    else the relative squared error."""
    if task is not None:
        return DetectLoss(task.layout)
    return kl_loss if teacher[0].ndim == 2 else relative_mse


def with_features(loss: Loss, n: int, weight: float) -> Loss:
    """``loss`` on the first ``n`` outputs plus ``weight`` times the mean relative squared error of the tensors
    after them (the block outputs a whole-model distillation also matches: a dense signal per image that a few
    hundred images' outputs alone do not give)."""
    if weight == 0:
        return loss

    def total(ys: list[torch.Tensor], ts: list[torch.Tensor]) -> torch.Tensor:
        extra = len(ys) - n
        features = relative_mse(ys[n:], ts[n:]) / extra if extra else ys[0].new_zeros(())
        return loss(ys[:n], ts[:n]) + weight * features

    return total
