"""``recover``: few-shot recovery of a pruned model from its teacher on unlabeled calibration data.

Two stages, run in this order by the default method ``block+distill``:

- ``block``: block-wise reconstruction. The student is cut at the tensors it shares with the
  teacher (see ``segments``); going from the input, the segments whose weights were changed by
  pruning, ``block_window`` of them together (``segments.windows``), are trained to reproduce the
  teacher's tensor at their end from the student's own tensor at their start, so they also correct
  the error of the segments before them.
- ``distill``: distillation towards the teacher's outputs (KL for classifiers, relative MSE
  otherwise) on consistently augmented inputs: both networks see the same randomly cropped,
  flipped and mixed images (see ``augment``): the whole model (``distill_segments=0``), augmented on the
  fly, or the last ``distill_segments`` segments (the head) on their inputs cached for ``distill_views``
  augmented views of every training sample. By default the whole model for a classifier where enough of its
  steps fit in the time, else the head (``options.distill_part``).

A held-out part of the calibration set is split in two: one half picks the best checkpoint of every
stage, the other judges the result (a verdict on the samples that picked the checkpoints would favour
them): the recovered model is returned only if it agrees better with the teacher on that half than
the input did, and only if onnxruntime on the written model reproduces the trained torch weights.
Samples the pruner fitted on make an optimistic held-out set: pass ``held`` samples it did not see.
"""

from __future__ import annotations

from onnxprune.recovery.augment import Mix
from onnxprune.recovery.options import METHODS, TRAIN, Layout, Method, Progress, RecoverOptions, Train
from onnxprune.recovery.report import DistillReport, RecoverReport, SegmentReport
from onnxprune.recovery.run import recover
from onnxprune.recovery.samples import discrepancy, halves, split
from onnxprune.recovery.segments import Segment

__all__ = ["METHODS", "TRAIN", "DistillReport", "Layout", "Method", "Mix", "Progress", "RecoverOptions", "RecoverReport",
           "Segment", "SegmentReport", "Train", "discrepancy", "halves", "recover", "split"]
