"""What a model's outputs mean, read from their layout: the task metrics of ``eval`` and the task's objective.

``infer_task`` reads the outputs of one run (shapes, and for a YOLOX export whether its boxes are decoded) and
the input's height and width; ``task_named`` builds the task a user names (``--task``). A ``Task`` gives
``metric()`` (an accumulator of the task's scores of a model against its reference, and against labels where
the task has them) and ``discrepancy(reference, outputs)`` (the objective the output allocation minimises).
"""

from __future__ import annotations

from onnxprune.tasks.base import Judge, Metric, Task, log_probs, raw_discrepancy
from onnxprune.tasks.ctc import CTC
from onnxprune.tasks.detect import CONF, NMS_IOU, Detect, HeatDetect, SetDetect
from onnxprune.tasks.boxes import box_iou
from onnxprune.tasks.infer import TASKS, image_hw, infer_task, task_named
from onnxprune.tasks.mask import Mask
from onnxprune.tasks.seq import Seq
from onnxprune.tasks.textdet import TextRegions

__all__ = ["CONF", "NMS_IOU", "TASKS", "CTC", "Detect", "HeatDetect", "Judge", "Mask", "Metric", "Seq", "SetDetect",
           "Task", "TextRegions", "box_iou", "image_hw", "infer_task", "log_probs", "raw_discrepancy", "task_named"]
