"""CTC text recognisers: greedy-decoded strings against the reference's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from onnxprune.tasks.base import Metric, Task
from onnxprune.tasks.boxes import Truth
from onnxprune.tasks.text import ctc_decode, edit_distance


@dataclass(frozen=True)
class CTC(Task):
    """A CTC text recogniser: its greedy-decoded strings against the reference's (exact and per character)."""

    output: int = 0
    time_major: bool = False
    blank: int = 0

    def metric(self) -> Metric:
        return CTCMetric(self)


class CTCMetric(Metric):
    def __init__(self, task: CTC) -> None:
        self.task = task
        self.same = self.total = self.edits = self.chars = 0

    def strings(self, ys: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
        y = ys[self.task.output]
        return ctc_decode(y.transpose(1, 0, 2) if self.task.time_major else y, self.task.blank)

    def update(self, ys: Sequence[np.ndarray], refs: Sequence[np.ndarray] | None,
               truths: Sequence[Truth] | None = None) -> None:
        if refs is None:
            return
        for a, b in zip(self.strings(ys), self.strings(refs)):
            self.same += a == b
            self.total += 1
            self.edits += edit_distance(a, b)
            self.chars += len(b)

    def result(self) -> dict[str, float | None]:
        if not self.total:
            return {}
        return {"string_agreement_ref": self.same / self.total,
                "char_agreement_ref": 1.0 - self.edits / max(self.chars, 1)}
