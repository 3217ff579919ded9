"""Which task a model's outputs show (``infer_task``: their shapes on one run and the input's size), and the task a
user names (``task_named``, ``--task``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxprune.errors import OptionError
from onnxprune.tasks.base import Task
from onnxprune.tasks.ctc import CTC
from onnxprune.tasks.detect import Detect, HeatDetect, SetDetect, detection_layout
from onnxprune.tasks.maps import MaskLayout, heat_layout, mask_layout
from onnxprune.tasks.mask import Mask
from onnxprune.tasks.seq import Seq
from onnxprune.tasks.sets import set_layout
from onnxprune.tasks.textdet import TextRegions

TASKS = ("auto", "classify", "detect", "segment", "heatmap", "mask", "ctc", "seq", "textdet", "raw")


def image_hw(x: np.ndarray) -> tuple[int, int] | None:
    """The height and width of an image batch, NCHW or NHWC (channels: 1, 3 or 4), else None."""
    if x.ndim != 4:
        return None
    if x.shape[1] in (1, 3, 4):
        return int(x.shape[2]), int(x.shape[3])
    return (int(x.shape[1]), int(x.shape[2])) if x.shape[3] in (1, 3, 4) else None


def infer_task(outputs: Sequence[np.ndarray], hw: tuple[int, int] | None, batch: int) -> Task:
    """The task of a model whose outputs on ``batch`` samples of an input of ``hw`` pixels are ``outputs``."""
    shapes = [o.shape for o in outputs]
    if hw is not None:
        layout = detection_layout(outputs, hw)
        if layout is not None:
            return Detect("segment" if layout.protos is not None else "detect", layout)
        sets = set_layout(outputs, hw)
        if sets is not None:
            return SetDetect("detect", sets)
    if len(shapes[0]) == 2:
        return Task("classify")
    if hw is not None:
        heat, mask = heat_layout(outputs, hw), mask_layout(outputs, hw)
        if heat is not None:
            return HeatDetect("heatmap", heat)
        if mask is not None:
            return Mask("mask", mask)
        y = shapes[0]
        if len(y) == 4 and y[1] == 1 and tuple(y[2:]) == tuple(hw):
            return TextRegions("textdet")
    y = shapes[0]
    if len(y) == 3 and y[2] > 1 and (y[0] == batch) != (y[1] == batch) and y[2] >= y[1 if y[0] == batch else 0]:
        return CTC("ctc", time_major=y[1] == batch and y[0] != batch)
    return Task("raw")


def task_named(name: str, outputs: Sequence[np.ndarray], hw: tuple[int, int] | None, batch: int) -> Task:
    """The task ``name`` (one of ``TASKS``) for these outputs; OptionError when they do not fit it."""
    if name not in TASKS:
        raise OptionError(f"task {name!r} is not one of {', '.join(TASKS)}", option="task")
    found = infer_task(outputs, hw, batch)
    if name in ("auto", found.name) or name == "detect" and found.name == "segment":
        return found if name != "detect" else Detect("detect", found.layout)
    if name in ("classify", "raw"):
        return Task(name)
    if name == "ctc" and len(outputs[0].shape) == 3:
        return CTC("ctc", time_major=outputs[0].shape[1] == batch and outputs[0].shape[0] != batch)
    if name == "seq" and any(o.ndim == 3 for o in outputs):
        return Seq("seq", output=max((i for i, o in enumerate(outputs) if o.ndim == 3), key=lambda i: outputs[i].shape[2]))
    if name == "textdet" and len(outputs[0].shape) == 4:
        return TextRegions("textdet")
    if name == "mask" and len(outputs[0].shape) == 4 and 1 in (outputs[0].shape[1], outputs[0].shape[3]):
        return Mask("mask", MaskLayout(0, channels_last=outputs[0].shape[1] != 1))
    shapes = ", ".join(str(list(o.shape)) for o in outputs)
    raise OptionError(f"task {name!r} does not fit this model's outputs ({shapes}; read as {found.name}): "
                      "leave out --task, or say which layout it has", option="task")
