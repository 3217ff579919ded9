"""Text detectors' probability maps: F1 of their regions against the reference's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnxprune.tasks.base import Metric, Task
from onnxprune.tasks.boxes import Truth
from onnxprune.tasks.text import matched_regions, regions


@dataclass(frozen=True)
class TextRegions(Task):
    """A text detector's probability map: F1 of its regions (binarised at 0.3) against the reference's, a region
    matching one of the other's at IoU ≥ 0.5."""

    output: int = 0

    def metric(self) -> Metric:
        return RegionMetric(self.output)


class RegionMetric(Metric):
    def __init__(self, output: int) -> None:
        self.output = output
        self.hits = self.found = self.truth = 0

    def update(self, ys: Sequence[np.ndarray], refs: Sequence[np.ndarray] | None,
               truths: Sequence[Truth] | None = None) -> None:
        if refs is None:
            return
        for y, r in zip(ys[self.output], refs[self.output]):
            mine, theirs = regions(y.reshape(y.shape[-2:])), regions(r.reshape(r.shape[-2:]))
            self.hits += matched_regions(mine, theirs)
            self.found += len(mine)
            self.truth += len(theirs)

    def result(self) -> dict[str, float | None]:
        if not self.found + self.truth:
            return {"region_f1_ref": None, "ref_regions": 0.0}
        return {"region_f1_ref": 2 * self.hits / (self.found + self.truth), "ref_regions": float(self.truth)}
