"""Detections from the common detector output layouts, non-maximum suppression and COCO-style mAP.

Layouts (``DetectionLayout``), all boxes in the model input's pixels:
- ``channels_first``: ultralytics YOLOv8/v11 ``[N, 4 + classes (+ mask coefficients), anchors]``, rows cx, cy,
  w, h then the class scores (sigmoid applied), then a mask head's coefficients (``masks``).
- ``anchors_first``: YOLOv5 / YOLOX ``[N, anchors, 5 + classes]``: cx, cy, w, h, objectness, class scores; a
  YOLOX export that leaves the grid decoding to its caller (``grid``: offsets and log sizes per cell of
  strides 8, 16, 32) is decoded here.
- ``split``: scores and boxes in outputs of their own, per level ``[N, cells, classes]`` with
  ``[N, cells, 4·(reg_max + 1)]`` distance distributions (PicoDet, GFL heads), or one ``[N, anchors, 4]``
  of xyxy boxes (PP-YOLOE).
- ``dense``: a dense face head (SCRFD, RetinaFace-like exports): per stride 8, 16, 32 (64, 128) and ``anchors`` a
  cell, the scores ``[N, anchors·cells, 1]``, then the box distances ``[N, anchors·cells, 4]`` (left, top, right,
  bottom from the cell's corner, in strides), then optionally 5 keypoints ``[N, anchors·cells, 10]`` (offsets in
  strides, carried as the detections' coefficients); an export that folds the batch into the rows (``[M, k]``)
  is read the same way.

``average_precision`` follows pycocotools' bbox evaluation (IoU thresholds .50:.05:.95, 101 recall points,
at most 100 detections per image, classes without ground truth left out) and is tested against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch

from onnxprune.imitation.threads import one_torch_thread

T = TypeVar("T")

STRIDES = ((8, 16, 32), (8, 16, 32, 64))
DENSE_STRIDES = (8, 16, 32, 64, 128)
IOU_THRESHOLDS = np.linspace(0.5, 0.95, 10)
RECALL_POINTS = np.linspace(0.0, 1.0, 101)
MAX_DETECTIONS = 100
SPREAD_RESAMPLES = 200  # bootstrap resamples of the images behind a score's standard deviation
PRE_NMS = 3000  # candidates kept by score before NMS, as ultralytics' max_nms keeps a bound


@dataclass
class Detections:
    """One image's detections: ``boxes`` (n, 4) xyxy in input pixels, ``scores`` (n,), ``classes`` (n,), and the
    mask coefficients (n, m) of a segmenter."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray
    coefficients: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.scores)

    def take(self, index: np.ndarray) -> Detections:
        return Detections(self.boxes[index], self.scores[index], self.classes[index],
                          None if self.coefficients is None else self.coefficients[index])


def cells(hw: tuple[int, int], strides: Sequence[int]) -> list[int]:
    """Grid cells per level of an input of ``hw`` pixels (exporters round the map sizes up)."""
    return [-(-hw[0] // s) * -(-hw[1] // s) for s in strides]


def grid_centres(hw: tuple[int, int], strides: Sequence[int], offset: float) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's (x, y) index + ``offset`` and its stride, levels concatenated: (A, 2), (A,)."""
    xy, stride = [], []
    for s in strides:
        h, w = -(-hw[0] // s), -(-hw[1] // s)
        xs, ys = np.meshgrid(np.arange(w), np.arange(h))
        xy.append(np.stack([xs.ravel(), ys.ravel()], 1) + offset)
        stride.append(np.full(h * w, s))
    return np.concatenate(xy).astype(np.float64), np.concatenate(stride).astype(np.float64)


def xywh_to_xyxy(b: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    parts = [b[..., :2] - b[..., 2:4] / 2, b[..., :2] + b[..., 2:4] / 2]
    return torch.cat(parts, dim=-1) if isinstance(b, torch.Tensor) else np.concatenate(parts, axis=-1)


def _grid(hw: tuple[int, int], strides: Sequence[int], offset: float, like: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``grid_centres`` as tensors of ``like``'s dtype and device."""
    xy, stride = grid_centres(hw, strides, offset)
    return torch.from_numpy(xy).to(like), torch.from_numpy(stride).to(like)


@dataclass(frozen=True)
class DetectionLayout:
    """Where a detector's boxes and scores are among its outputs (see the module's docstring)."""

    kind: str  # "channels_first", "anchors_first", "split" or "dense"
    hw: tuple[int, int]  # the input's height and width
    classes: int
    outputs: tuple[int, ...] = (0,)  # channels_first / anchors_first: the output; split: score outputs
    box_outputs: tuple[int, ...] = ()  # split: the box outputs, level by level as the score outputs
    masks: int = 0  # mask coefficients per detection (channels_first with a prototype output)
    protos: int | None = None  # the output holding the mask prototypes
    grid: tuple[int, ...] | None = None  # anchors_first: strides of a grid the export did not decode
    reg_max: int | None = None  # split: bins per side of the distance distributions, less one
    anchors: int = 1  # dense: anchors a cell
    kps_outputs: tuple[int, ...] = ()  # dense: the keypoint outputs, level by level

    def candidates(self, outputs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Per anchor: xyxy boxes (N, A, 4), class scores (N, A, C) and mask coefficients (N, A, M) or None
        (``decoded`` on float64 copies of the outputs it reads)."""
        read = {*self.outputs, *self.box_outputs, *self.kps_outputs}
        ys = [torch.from_numpy(np.asarray(o, np.float64)) if i in read else None for i, o in enumerate(outputs)]
        with one_torch_thread():
            return tuple(None if t is None else t.numpy() for t in self.decoded(ys))

    def decoded(self, ys: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``candidates`` on torch tensors, differentiable: what ``eval`` reads is what ``recover`` trains on."""
        if self.kind == "channels_first":
            y = ys[self.outputs[0]].transpose(1, 2)
            coef = y[..., 4 + self.classes:4 + self.classes + self.masks] if self.masks else None
            return xywh_to_xyxy(y[..., :4]), y[..., 4:4 + self.classes], coef
        if self.kind == "anchors_first":
            y = ys[self.outputs[0]]
            box = y[..., :4]
            if self.grid is not None:
                xy, stride = _grid(self.hw, self.grid, 0.0, y)
                box = torch.cat([(box[..., :2] + xy) * stride[:, None],
                                 torch.exp(box[..., 2:4].clamp(max=30.0)) * stride[:, None]], dim=-1)
            return xywh_to_xyxy(box), y[..., 4:5] * y[..., 5:5 + self.classes], None
        if self.kind == "dense":
            return self._dense(ys)
        scores = torch.cat([ys[i] for i in self.outputs], dim=1)
        raw = torch.cat([ys[i] for i in self.box_outputs], dim=1)
        if self.reg_max is None:
            return raw[..., :4], scores, None
        centre, stride = _grid(self.hw, STRIDES[1][: len(self.outputs)], 0.5, raw)
        bins = torch.softmax(raw.reshape(*raw.shape[:2], 4, self.reg_max + 1), dim=-1)
        dist = (bins @ torch.arange(self.reg_max + 1).to(raw)) * stride[:, None]
        centre = centre * stride[:, None]
        return torch.cat([centre - dist[..., :2], centre + dist[..., 2:]], dim=-1), scores, None

    def _dense(self, ys: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``decoded`` of a dense face head: boxes and keypoints placed from each anchor's cell corner."""
        strides = DENSE_STRIDES[: len(self.outputs)]
        sizes = [self.anchors * c for c in cells(self.hw, strides)]

        def levels(which: tuple[int, ...], width: int) -> torch.Tensor:
            return torch.cat([ys[i].reshape(-1, m, width) for i, m in zip(which, sizes)], dim=1)

        like = ys[self.outputs[0]]
        corner, stride = _grid(self.hw, strides, 0.0, like)
        corner = torch.repeat_interleave(corner * stride[:, None], self.anchors, dim=0)
        stride = torch.repeat_interleave(stride, self.anchors)[:, None]
        dist = levels(self.box_outputs, 4) * stride
        boxes = torch.cat([corner - dist[..., :2], corner + dist[..., 2:]], dim=-1)
        kps = None
        if self.kps_outputs:
            points = levels(self.kps_outputs, 10).reshape(-1, len(corner), 5, 2) * stride[:, :, None]
            kps = (points + corner[:, None, :]).reshape(-1, len(corner), 10)
        return boxes, levels(self.outputs, 1), kps

    def decode(self, outputs: Sequence[np.ndarray], conf: float, iou: float) -> list[Detections]:
        """Each image's detections of score ≥ ``conf`` after class-aware NMS at ``iou`` (best class per anchor)."""
        boxes, scores, coef = self.candidates(outputs)
        out = []
        for i in range(len(boxes)):
            cls = scores[i].argmax(axis=1)
            best = scores[i][np.arange(len(cls)), cls]
            keep = np.flatnonzero(best >= conf)
            keep = keep[np.argsort(-best[keep], kind="stable")[:PRE_NMS]]
            det = Detections(boxes[i][keep], best[keep], cls[keep], None if coef is None else coef[i][keep])
            out.append(det.take(nms(det.boxes, det.scores, det.classes, iou)))
        return out


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every xyxy box of ``a`` (n, 4) with every one of ``b`` (m, 4): (n, m)."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float) -> np.ndarray:
    """Indices kept by greedy class-aware NMS, best score first."""
    order = np.argsort(-scores, kind="stable")
    if not len(order):
        return order
    shifted = boxes + (np.abs(boxes).max() + 1) * 2 * classes[:, None].astype(np.float64)  # classes never overlap
    keep = []
    while len(order):
        i, rest = order[0], order[1:]
        keep.append(i)
        order = rest[box_iou(shifted[i:i + 1], shifted[rest])[0] <= iou]
    return np.asarray(keep, dtype=np.int64)


@dataclass
class Truth:
    """One image's ground truth: xyxy ``boxes`` (n, 4) and ``classes`` (n,)."""

    boxes: np.ndarray
    classes: np.ndarray


@dataclass
class APAccumulator:
    """Matches detections to ground truth image by image; ``result()`` is mAP50 and mAP50-95 over the classes
    that have ground truth (None when no image has any)."""

    records: dict[int, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)  # class -> (scores, tp)
    truths: dict[int, int] = field(default_factory=dict)  # class -> ground-truth boxes

    def add(self, det: Detections, truth: Truth) -> None:
        for c in np.union1d(np.unique(det.classes), np.unique(truth.classes)).astype(int):
            d = det.take(np.flatnonzero(det.classes == c))
            d = d.take(np.argsort(-d.scores, kind="mergesort")[:MAX_DETECTIONS])
            g = truth.boxes[truth.classes == c]
            self.truths[c] = self.truths.get(c, 0) + len(g)
            self.records.setdefault(c, []).append((d.scores, match(d.boxes, g)))

    @classmethod
    def pooled(cls, parts: Sequence[APAccumulator]) -> APAccumulator:
        """The images of ``parts`` in one accumulator (a part listed twice counts twice: a bootstrap resample)."""
        out = cls()
        for part in parts:
            for c, records in part.records.items():
                out.records.setdefault(c, []).extend(records)
            for c, n in part.truths.items():
                out.truths[c] = out.truths.get(c, 0) + n
        return out

    def result(self) -> dict[str, float | None]:
        ap = []
        for c, n in self.truths.items():
            if n == 0:
                continue
            scores = np.concatenate([s for s, _ in self.records[c]])
            tp = np.concatenate([t for _, t in self.records[c]], axis=0)
            order = np.argsort(-scores, kind="mergesort")
            ap.append([precision_at_recall(tp[order, t], n) for t in range(len(IOU_THRESHOLDS))])
        if not ap:
            return {"mAP50": None, "mAP50-95": None}
        table = np.asarray(ap)
        return {"mAP50": float(table[:, 0].mean()), "mAP50-95": float(table.mean())}


def bootstrap_sd(images: Sequence[T], score: Callable[[list[T]], Mapping[str, float | None]] | None = None,
                 resamples: int = SPREAD_RESAMPLES, seed: int = 0) -> dict[str, float]:
    """The standard deviation of each of ``score``'s scores (by name) over ``resamples`` bootstrap resamples of
    ``images`` (one item each, drawn with replacement); a resample whose score is None is left out of it, and none
    is given where fewer than two resamples have one. ``score`` pools the drawn items; by default they are
    ``APAccumulator``s and the scores mAP50 and mAP50-95 (a resample without ground truth has none). On nudenet's
    YOLOv8n at 0.70×, judged on 59 photos whose 88 reference detections fall in 12 classes, 5 of them with at most 2,
    mAP50-95 0.830 has a standard deviation of 0.026, as large as most changes worth measuring (the notebook's "Four
    splits")."""
    score = score or (lambda drawn: APAccumulator.pooled(drawn).result())
    gen = np.random.default_rng(seed)
    found: dict[str, list[float]] = {}
    for _ in range(resamples if len(images) > 1 else 0):
        for name, value in score([images[i] for i in gen.integers(0, len(images), len(images))]).items():
            if value is not None:
                found.setdefault(name, []).append(value)
    return {name: float(np.std(values)) for name, values in found.items() if len(values) > 1}


def match(boxes: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """(detections, thresholds) bool: whether each detection, in the given (score) order, takes a ground-truth
    box not yet taken at each IoU threshold (the unmatched one of highest IoU, as pycocotools matches)."""
    tp = np.zeros((len(boxes), len(IOU_THRESHOLDS)), dtype=bool)
    if not len(boxes) or not len(truth):
        return tp
    ious = box_iou(boxes, truth)
    for t, thr in enumerate(IOU_THRESHOLDS):
        taken = np.zeros(len(truth), dtype=bool)
        for d in range(len(boxes)):
            cand = np.where(taken, -1.0, ious[d])
            g = int(cand.argmax())
            if cand[g] >= thr - 1e-10:  # pycocotools compares with min(t, 1 - 1e-10)
                taken[g], tp[d, t] = True, True
    return tp


def precision_at_recall(tp: np.ndarray, truths: int) -> float:
    """AP of detections in score order with ``tp`` flags: pycocotools' precision at 101 recall points."""
    if not len(tp):
        return 0.0
    ctp, cfp = np.cumsum(tp), np.cumsum(~tp)
    recall = ctp / truths
    precision = ctp / np.maximum(ctp + cfp, np.spacing(1))
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    idx = np.searchsorted(recall, RECALL_POINTS, side="left")
    return float(np.where(idx < len(precision), precision[np.minimum(idx, len(precision) - 1)], 0.0).mean())
