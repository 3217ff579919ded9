"""Detectors whose outputs are a set of detections, not a score for every anchor: NMS done in the graph, or none
needed (NMS-free end-to-end heads).

Layouts (``SetLayout``), boxes in the model input's pixels:
- ``rows``: ``[N, K, 6]``, each row x1, y1, x2, y2, score, class (YOLOv10 / YOLO26 end-to-end exports, an
  ultralytics export with its NMS);
- ``queries``: ``[N, K, 4 + C]``, each query's cx, cy, w, h (in pixels, or in [0, 1] of the input) and its class
  scores (RT-DETR, DETR-style heads);
- ``parts``: the boxes ``[N, K, 4]`` (xyxy) and scores ``[N, K]`` in outputs of their own, with the classes
  ``[N, K]`` and a detection count ``[N, 1]`` where the export writes them (TensorRT-style
  num_dets / boxes / scores / classes).

The slots of a set are not anchors: their order follows the scores, so two models' sets are compared by matching
(``set_discrepancy``), never slot by slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxprune.tasks.boxes import Detections, box_iou, cells, xywh_to_xyxy

MAX_SET = 1000  # a set of at most this many slots; more is an anchor grid
WEIGHT_FLOOR = 0.05  # detections scored below this count for nothing in the objective


@dataclass(frozen=True)
class SetLayout:
    """Where a set of detections is among a model's outputs (see the module's docstring)."""

    kind: str  # "rows", "queries" or "parts"
    hw: tuple[int, int]
    boxes: int  # rows / queries: the one output; parts: the boxes
    scores: int | None = None  # parts
    classes: int | None = None  # parts, where written
    count: int | None = None  # parts, where written
    normalized: bool = False  # queries: the boxes are fractions of the input's size
    protos: int | None = None  # no mask prototypes (what ``DetectionMetric`` asks of a layout)

    def detections(self, outputs: Sequence[np.ndarray]) -> list[Detections]:
        """Every image's detections, all slots, best class of each (a slot past a written count is dropped)."""
        y = np.asarray(outputs[self.boxes], np.float64)
        if self.kind == "rows":
            boxes, scores, classes = y[..., :4], y[..., 4], y[..., 5]
        elif self.kind == "queries":
            boxes = xywh_to_xyxy(y[..., :4])
            if self.normalized:
                boxes = boxes * np.array([self.hw[1], self.hw[0]] * 2)
            probs = y[..., 4:]
            if probs.min() < 0 or probs.max() > 1:  # logits
                probs = 1 / (1 + np.exp(-probs))
            classes, scores = probs.argmax(axis=-1), probs.max(axis=-1)
        else:
            boxes = y
            scores = np.asarray(outputs[self.scores], np.float64).reshape(y.shape[:2])
            classes = (np.zeros_like(scores) if self.classes is None
                       else np.asarray(outputs[self.classes], np.float64).reshape(y.shape[:2]))
        counts = (np.full(len(y), y.shape[1]) if self.count is None
                  else np.asarray(outputs[self.count]).reshape(len(y)).astype(np.int64))
        return [Detections(boxes[i, :n], scores[i, :n], classes[i, :n].astype(np.int64))
                for i, n in enumerate(np.clip(counts, 0, y.shape[1]))]

    def decode(self, outputs: Sequence[np.ndarray], conf: float, iou: float) -> list[Detections]:
        """Each image's detections of score ≥ ``conf``, best first (the graph did the NMS, or needs none)."""
        out = []
        for d in self.detections(outputs):
            order = np.argsort(-d.scores, kind="stable")
            out.append(d.take(order[d.scores[order] >= conf]))
        return out


def set_layout(outputs: Sequence[np.ndarray], hw: tuple[int, int]) -> SetLayout | None:
    """The set layout of these outputs (one run's), or None."""
    shapes = [o.shape for o in outputs]
    grids = {sum(cells(hw, s)) for s in ((8, 16, 32), (8, 16, 32, 64))}
    first = shapes[0]
    if len(first) == 3 and first[1] <= MAX_SET and first[1] not in grids:
        y = np.asarray(outputs[0], np.float64)
        if first[2] == 6 and np.array_equal(y[..., 5], np.round(y[..., 5])) and (y[..., 5] >= 0).all():
            return SetLayout("rows", hw, 0)
        if 4 + 1 < first[2] < first[1] + 4 and _boxes_first(y, hw):  # more queries than classes (not a recogniser)
            return SetLayout("queries", hw, 0, normalized=bool(y[..., :4].max() <= 1.5))
    boxes = next((i for i, s in enumerate(shapes) if len(s) == 3 and s[2] == 4 and s[1] <= MAX_SET), None)
    if boxes is None:
        return None
    n, k = shapes[boxes][:2]
    per_slot = [i for i, s in enumerate(shapes) if i != boxes and tuple(s) in ((n, k), (n, k, 1))]
    count = next((i for i, s in enumerate(shapes) if tuple(s) in ((n, 1), (n,))), None)
    if not per_slot or len(per_slot) > 2 or len(shapes) != 1 + len(per_slot) + (count is not None):
        return None  # not one set of boxes, scores, classes and a count (a dense head's per-level outputs)
    scores = next((i for i in per_slot if not np.array_equal(outputs[i], np.round(outputs[i]))), per_slot[0])
    classes = next((i for i in per_slot if i != scores), None)
    return SetLayout("parts", hw, boxes, scores=scores, classes=classes, count=count)


def _boxes_first(y: np.ndarray, hw: tuple[int, int]) -> bool:
    """Whether rows ``y`` [N, K, 4 + C] read as boxes (cx, cy, w, h, non-negative, some of some size, within the input
    or in [0, 1]) then class scores that are not one distribution per row (a recogniser's per-step softmax)."""
    box, scores = y[..., :4], y[..., 4:]
    if box.size == 0 or box.min() < 0 or box.max() > 1.5 * max(hw) or not (box[..., 2:] > 0).any():
        return False
    return not (scores.min() >= 0 and np.allclose(y.sum(axis=-1), 1.0, atol=1e-3))


def set_discrepancy(layout: SetLayout, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
    """How far the model's detections are from the reference's, in [0, 1]: each detection scored at least
    ``WEIGHT_FLOOR``, on either side, weighs its score and counts ``1 - IoU × score ratio`` against its best
    same-class match on the other side (0: every detection found again, in place and as sure)."""
    missed = weight = 0.0
    for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
        refs = layout.decode(list(ref_chunk.values()), WEIGHT_FLOOR, 1.0)
        ours = layout.decode([out_chunk[k] for k in ref_chunk], WEIGHT_FLOOR, 1.0)
        for a, b in zip(refs, ours):
            for one, other in ((a, b), (b, a)):
                m, w = _missed(one, other)
                missed, weight = missed + m, weight + w
    return missed / weight if weight else 0.0


def _missed(a: Detections, b: Detections) -> tuple[float, float]:
    """Σ over ``a``'s detections of score × (1 - best IoU × score ratio among ``b``'s of its class), and Σ score."""
    if not len(a):
        return 0.0, 0.0
    total = float(a.scores.sum())
    if not len(b):
        return total, total
    same = a.classes[:, None] == b.classes[None, :]
    ratio = np.minimum(a.scores[:, None], b.scores[None, :]) / np.maximum(a.scores[:, None], b.scores[None, :])
    best = (box_iou(a.boxes, b.boxes) * ratio * same).max(axis=1)
    return float((a.scores * (1.0 - best)).sum()), total
