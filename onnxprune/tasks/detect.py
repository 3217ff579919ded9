"""Detectors: raw-grid, DFL and split-head outputs (``tasks.boxes``), sets of detections (``tasks.sets``) and
heat maps (``tasks.maps``) scored by mAP against the reference's detections; instance masks by their IoU."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np

from onnxprune.tasks.base import Judge, Metric, Task
from onnxprune.tasks.boxes import (DENSE_STRIDES, STRIDES, APAccumulator, DetectionLayout, Detections, Truth,
                                      bootstrap_sd, cells)
from onnxprune.tasks.maps import HeatLayout
from onnxprune.tasks.sets import SetLayout, set_discrepancy

CONF = 0.25  # a detection the user sees (ultralytics' predict default)
LOW_CONF = 0.001  # the detections ranked for mAP (ultralytics' val default)
NMS_IOU = 0.5
BOX_WEIGHT_FLOOR = 0.05  # the objective's boxes count on anchors the reference scores at least this


@dataclass(frozen=True)
class Detect(Task):
    """A detector (and with prototypes, an instance segmenter): mAP of the model's detections against the
    reference's (score ≥ ``conf``, the reference as ground truth) and against labels."""

    layout: DetectionLayout | SetLayout | HeatLayout | None = None
    conf: float = CONF
    iou: float = NMS_IOU

    def metric(self) -> Metric:
        return DetectionMetric(self)

    def with_objects(self, reference: Sequence[Mapping[str, np.ndarray]]) -> np.ndarray:
        """Whether each image of the reference's chunks (outputs in the order the layout counts them by) shows a
        detection of score ≥ ``conf``."""
        return np.array([len(d) > 0 for chunk in reference
                         for d in self.layout.decode(list(chunk.values()), self.conf, self.iou)], dtype=bool)

    def object_map(self, outputs: Sequence[np.ndarray], stride: int) -> np.ndarray | None:
        """Per image of ``outputs`` (the model's, in the order the layout counts them by), a map on a grid of
        ``stride`` pixels: at the cell of each anchor's box centre, the best class score of the anchors scoring at
        least ``BOX_WEIGHT_FLOOR`` there (the objective's objects), 0 elsewhere; None for a head that does not list
        its anchors (a set of detections, a heat map)."""
        if not isinstance(self.layout, DetectionLayout):
            return None
        boxes, scores, _ = self.layout.candidates(list(outputs))
        best = scores.max(axis=2)
        h, w = -(-self.layout.hw[0] // stride), -(-self.layout.hw[1] // stride)
        out = np.zeros((len(best), h, w), np.float32)
        for i, (b, s) in enumerate(zip(boxes, best)):
            on = np.flatnonzero(s >= BOX_WEIGHT_FLOOR)
            x = np.clip(np.floor((b[on, 0] + b[on, 2]) / (2 * stride)), 0, w - 1).astype(np.int64)
            y = np.clip(np.floor((b[on, 1] + b[on, 3]) / (2 * stride)), 0, h - 1).astype(np.int64)
            np.maximum.at(out[i], (y, x), s[on].astype(np.float32))
        return out

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        """``judge(reference)(outputs)``: each kind of head reads its reference its own way."""
        return self.judge(reference)(outputs)

    def judge(self, reference: Sequence[Mapping[str, np.ndarray]]) -> Judge:
        """The class scores' squared error over the reference's, on every anchor, plus the boxes' absolute error
        (the four edges) in units of each box's size, weighted by the reference's best class score where it is at
        least ``BOX_WEIGHT_FLOOR`` (an object), over the weights (the mask coefficients' squared error likewise);
        the reference's candidates, weights and energy decoded once. Its chunks hold the outputs in the order the
        layout counts them by. The box error is linear, as 1 - IoU is to first order: mAP50-95's thresholds up to
        0.95 count small errors on every box, which a squared error makes negligible beside a few large ones."""
        chunks = []
        energy = weight = 0.0
        for ref_chunk in reference:
            rb, rs, rc = self.layout.candidates(list(ref_chunk.values()))
            w = rs.max(axis=2)
            w = np.where(w >= BOX_WEIGHT_FLOOR, w, 0.0)
            size = np.maximum(np.maximum(rb[..., 2] - rb[..., 0], rb[..., 3] - rb[..., 1]), 1.0)
            coef = None if rc is None else np.maximum(np.mean(np.square(rc), axis=2), 1e-12)
            chunks.append((list(ref_chunk), rb, rs, rc, w, size, coef))
            energy += float(np.sum(np.square(rs)))
            weight += float(w.sum())

        def against(outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
            err = box_err = 0.0
            for (names, rb, rs, rc, w, size, coef), out_chunk in zip(chunks, outputs, strict=True):
                yb, ys, yc = self.layout.candidates([out_chunk[k] for k in names])
                err += float(np.sum(np.square(ys - rs)))
                box_err += float(np.sum(w * np.sum(np.abs(yb - rb), axis=2) / size))
                if rc is not None:
                    box_err += float(np.sum(w * np.mean(np.square(yc - rc), axis=2) / coef))
            return err / max(energy, 1e-30) + box_err / max(weight, 1e-30)

        return against


@dataclass(frozen=True)
class SetDetect(Detect):
    """A detector whose outputs are a set of detections (NMS in the graph, or NMS-free; ``tasks.sets``): its sets
    matched to the reference's for the objective, its mAP against the reference's for ``eval``."""

    def judge(self, reference: Sequence[Mapping[str, np.ndarray]]) -> Judge:
        return partial(set_discrepancy, self.layout, reference)


@dataclass(frozen=True)
class HeatDetect(Detect):
    """A CenterNet-style detector (``tasks.maps.HeatLayout``): its heat map's peaks as detections."""

    def judge(self, reference: Sequence[Mapping[str, np.ndarray]]) -> Judge:
        return partial(self.layout.discrepancy, reference)


class DetectionMetric(Metric):
    def __init__(self, task: Detect) -> None:
        self.task = task
        self.images: list[APAccumulator] = []  # per image, against the reference's detections
        self.vs_labels = APAccumulator()
        self.with_objects = self.found = 0
        self.compared = False  # a reference was given
        self.masks: MaskIoU | None = MaskIoU(task.layout) if task.layout.protos is not None else None

    def update(self, ys: Sequence[np.ndarray], refs: Sequence[np.ndarray] | None,
               truths: Sequence[Truth] | None = None) -> None:
        t = self.task
        dets = t.layout.decode(ys, LOW_CONF, t.iou)
        if refs is not None:
            self.compared = True
            seen = t.layout.decode(refs, t.conf, t.iou)
            for d, r in zip(dets, seen):
                self.images.append(APAccumulator())
                self.images[-1].add(d, Truth(r.boxes, r.classes))
                self.with_objects += bool(len(r))
                self.found += len(r)
            if self.masks is not None:
                self.masks.add(ys, refs, [d.take(np.flatnonzero(d.scores >= t.conf)) for d in dets], seen)
        if truths is not None:
            for d, truth in zip(dets, truths, strict=True):
                self.vs_labels.add(d, truth)

    def result(self) -> dict[str, float | None]:
        out: dict[str, float | None] = {}
        if self.compared:
            ref = APAccumulator.pooled(self.images).result()
            out.update({"mAP50_ref": ref["mAP50"], "mAP50-95_ref": ref["mAP50-95"],
                        "ref_detections": float(self.found), "ref_images_with_objects": float(self.with_objects)})
        if self.vs_labels.truths:
            labels = self.vs_labels.result()
            out.update({"mAP50_labels": labels["mAP50"], "mAP50-95_labels": labels["mAP50-95"]})
        if self.masks is not None and self.compared:
            out["mask_iou_ref"] = self.masks.result()
        return out

    def spread(self) -> dict[str, float]:
        """The bootstrap standard deviation over the images of mAP50_ref and mAP50-95_ref (``bootstrap_sd``)."""
        if not self.compared:
            return {}
        return {f"{name}_ref": value for name, value in bootstrap_sd(self.images).items()}


class MaskIoU:
    """Instance masks of a segmenter (coefficients × prototypes, sigmoid > 0.5, inside the box), united per class
    and image; the IoU of the model's union with the reference's, pooled over images and classes."""

    def __init__(self, layout: DetectionLayout) -> None:
        self.layout = layout
        self.inter = self.union = 0

    def masks(self, protos: np.ndarray, det: Detections) -> dict[int, np.ndarray]:
        m, h, w = protos.shape
        if not len(det):
            return {}
        logits = det.coefficients @ protos.reshape(m, -1).astype(np.float64)
        masks = (logits.reshape(-1, h, w) > 0)  # sigmoid > 0.5
        sy, sx = h / self.layout.hw[0], w / self.layout.hw[1]
        ys, xs = np.arange(h)[:, None] + 0.5, np.arange(w)[None, :] + 0.5
        out: dict[int, np.ndarray] = {}
        for mask, box, c in zip(masks, det.boxes, det.classes):
            inside = (xs >= box[0] * sx) & (xs < box[2] * sx) & (ys >= box[1] * sy) & (ys < box[3] * sy)
            out[int(c)] = out.get(int(c), np.zeros((h, w), bool)) | (mask & inside)
        return out

    def add(self, ys: Sequence[np.ndarray], refs: Sequence[np.ndarray], dets: list[Detections],
            seen: list[Detections]) -> None:
        p = self.layout.protos
        for i, (d, r) in enumerate(zip(dets, seen)):
            mine, theirs = self.masks(ys[p][i], d), self.masks(refs[p][i], r)
            for c in set(mine) | set(theirs):
                a = mine.get(c, np.zeros_like(next(iter((mine or theirs).values()))))
                b = theirs.get(c, np.zeros_like(a))
                self.inter += int((a & b).sum())
                self.union += int((a | b).sum())

    def result(self) -> float | None:
        return self.inter / self.union if self.union else None


def detection_layout(outputs: Sequence[np.ndarray], hw: tuple[int, int]) -> DetectionLayout | None:
    """The detection layout these outputs have (see ``DetectionLayout``), or None."""
    shapes = [o.shape for o in outputs]
    grids = {k * sum(cells(hw, s)): s for s in STRIDES for k in (1, 3)}
    first = shapes[0]
    if len(first) == 3 and first[2] in grids and 4 < first[1] < first[2]:
        protos = next((i for i, s in enumerate(shapes[1:], 1) if len(s) == 4 and s[1] < first[1] - 4), None)
        masks = shapes[protos][1] if protos is not None else 0
        return DetectionLayout("channels_first", hw, first[1] - 4 - masks, masks=masks, protos=protos)
    if len(first) == 3 and first[1] in grids and 5 < first[2] < first[1]:
        y = np.asarray(outputs[0], np.float64)
        strides = grids[first[1]]
        raw = first[1] == sum(cells(hw, strides)) and np.percentile(np.abs(y[..., :2]), 99) < 4.0
        return DetectionLayout("anchors_first", hw, first[2] - 5, grid=strides if raw else None)
    return _split_layout(shapes, hw) or _dense_layout(shapes, hw)


def _split_layout(shapes: list[tuple[int, ...]], hw: tuple[int, int]) -> DetectionLayout | None:
    """Scores and boxes in outputs of their own (PicoDet's per-level pairs, or one merged pair)."""
    if len(shapes) < 2 or any(len(s) != 3 for s in shapes) or len(shapes) % 2:
        return None
    half = len(shapes) // 2
    scores, boxes = shapes[:half], shapes[half:]
    if any(s[1] != b[1] for s, b in zip(scores, boxes)) or len({s[2] for s in scores}) != 1:
        return None
    classes, width = scores[0][2], boxes[0][2]
    if half == 1 and width == 4:
        return DetectionLayout("split", hw, classes, outputs=(0,), box_outputs=(1,))
    strides = STRIDES[1][:half]
    if width % 4 or width < 8 or [s[1] for s in scores] != cells(hw, strides):
        return None
    return DetectionLayout("split", hw, classes, outputs=tuple(range(half)), box_outputs=tuple(range(half, 2 * half)),
                           reg_max=width // 4 - 1)


def _dense_layout(shapes: list[tuple[int, ...]], hw: tuple[int, int]) -> DetectionLayout | None:
    """A dense face head (``DetectionLayout`` kind ``dense``): 3 or 5 levels of scores (width 1), box distances
    (width 4) and optionally keypoints (width 10), each level ``anchors`` times the cells of its stride."""
    for levels in (3, 5):
        if len(shapes) not in (2 * levels, 3 * levels) or any(len(s) not in (2, 3) for s in shapes):
            continue
        widths = [s[-1] for s in shapes]
        if widths != [w for w in (1, 4, 10)[: len(shapes) // levels] for _ in range(levels)]:
            continue
        grid = cells(hw, DENSE_STRIDES[:levels]) * (len(shapes) // levels)
        # per image: the rows of a [N, rows, k] output; a batch folded into the rows ([M, k]) is read as one image,
        # and SCRFD's two anchors a cell are preferred where the count allows both
        rows = [s[1] if len(s) == 3 else s[0] for s in shapes]
        anchors = next((a for a in (2, 1, 3) if all(r % (a * c) == 0 and (len(s) == 2 or r == a * c)
                                                     for r, c, s in zip(rows, grid, shapes))), None)
        if anchors is None or any(len(s) == 2 and r // (anchors * c) != rows[0] // (anchors * grid[0])
                                  for r, c, s in zip(rows, grid, shapes)):
            continue
        return DetectionLayout("dense", hw, 1, outputs=tuple(range(levels)), box_outputs=tuple(range(levels, 2 * levels)),
                               kps_outputs=tuple(range(2 * levels, len(shapes))), anchors=anchors)
    return None
