"""Binary and salient masks: the IoU of the binarised masks (``tasks.maps.MaskLayout``)."""

from __future__ import annotations

from dataclasses import dataclass

from onnxprune.tasks.base import Metric, Task
from onnxprune.tasks.maps import MaskLayout, MaskMetric


@dataclass(frozen=True)
class Mask(Task):
    """A binary or salient mask (``tasks.maps.MaskLayout``): the IoU of the binarised masks."""

    layout: MaskLayout = MaskLayout()

    def metric(self) -> Metric:
        return MaskMetric(self.layout)
