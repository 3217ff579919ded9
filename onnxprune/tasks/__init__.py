"""What a model's outputs mean, read from their layout: the task metrics of ``eval`` and the task's objective.

``infer_task`` reads the outputs of one run (shapes, and for a YOLOX export whether its boxes are decoded) and
the input's height and width; ``task_named`` builds the task a user names (``--task``). A ``Task`` gives
``metric()`` (an accumulator of the task's scores of a model against its reference, and against labels where
the task has them) and ``discrepancy(reference, outputs)`` (the objective the output allocation minimises).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxprune.errors import OptionError
from onnxprune.ir.ort import zero_pad
from onnxprune.tasks.detection import (STRIDES, APAccumulator, DetectionLayout, Detections, Truth, box_iou, cells)
from onnxprune.tasks.maps import HeatLayout, MaskLayout, MaskMetric, heat_layout, mask_layout
from onnxprune.tasks.sets import SetLayout, set_discrepancy, set_layout
from onnxprune.tasks.text import ctc_decode, edit_distance, matched_regions, regions

TASKS = ("auto", "classify", "detect", "segment", "heatmap", "mask", "ctc", "seq", "textdet", "raw")
CONF = 0.25  # a detection the user sees (ultralytics' predict default)
LOW_CONF = 0.001  # the detections ranked for mAP (ultralytics' val default)
NMS_IOU = 0.5
MASK_THRESHOLD = 0.5
BOX_WEIGHT_FLOOR = 0.05  # the objective's boxes count on anchors the reference scores at least this


class Metric:
    """Accumulates a task's scores batch by batch (``update``); ``result()`` names each score."""

    def update(self, ys: Sequence[np.ndarray], refs: Sequence[np.ndarray] | None,
               truths: Sequence[Truth] | None = None) -> None:
        raise NotImplementedError

    def result(self) -> dict[str, float | None]:
        raise NotImplementedError


@dataclass(frozen=True)
class Task:
    """A model's task: its name, and how its outputs are read."""

    name: str

    def metric(self) -> Metric | None:
        """The task's accumulator (None: the classifier's and the raw tensors' metrics are ``evaluate``'s own)."""
        return None

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        """The output discrepancy over chunks of samples (output name -> array): KL for a classifier's 2-D
        logits, the squared error's energy over the reference's for other outputs, summed over outputs."""
        return raw_discrepancy(reference, outputs)


def raw_discrepancy(reference: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Mapping[str, np.ndarray]]
                    ) -> float:
    """Summed over the float outputs of chunks of samples: the mean KL(reference || output) over the rows of a 2-D
    output with several columns (logits, or probabilities, see ``log_probs``), else the squared error's energy over
    the reference's."""
    kl, rows, err, energy = {}, {}, {}, {}
    for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
        for name, ref in ref_chunk.items():
            ref, y = ref.astype(np.float64), out_chunk[name].astype(np.float64)
            if ref.ndim == 2 and ref.shape[1] > 1:
                log_p, log_q = log_probs(ref), log_probs(y)
                kl[name] = kl.get(name, 0.0) + float(np.sum(np.exp(log_p) * (log_p - log_q)))
                rows[name] = rows.get(name, 0) + len(ref)
            else:
                ref, y = zero_pad(ref, y)  # a decoded sequence may be longer in one of them
                err[name] = err.get(name, 0.0) + float(np.sum(np.square(y - ref)))
                energy[name] = energy.get(name, 0.0) + float(np.sum(np.square(ref)))
    return sum(kl[k] / rows[k] for k in kl) + sum(err[k] / max(energy[k], 1e-30) for k in err)


def log_probs(x: np.ndarray) -> np.ndarray:
    """Row-wise log-probabilities in float64: of the rows themselves when they are probabilities already
    (non-negative, summing to 1: a model that ends in Softmax), else their log-softmax (logits)."""
    x = x.astype(np.float64)
    if np.all(x >= 0) and np.allclose(x.sum(axis=1), 1.0, atol=1e-3):
        return np.log(np.maximum(x, 1e-12))
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@dataclass(frozen=True)
class Detect(Task):
    """A detector (and with prototypes, an instance segmenter): mAP of the model's detections against the
    reference's (score ≥ ``conf``, the reference as ground truth) and against labels."""

    layout: DetectionLayout | SetLayout | HeatLayout | None = None
    conf: float = CONF
    iou: float = NMS_IOU

    def metric(self) -> Metric:
        return DetectionMetric(self)

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        """The class scores' squared error over the reference's, on every anchor, plus the boxes' squared error
        in units of each box's size, weighted by the reference's best class score where it is at least
        ``BOX_WEIGHT_FLOOR`` (an object), over the weights (the mask coefficients likewise). The reference's
        chunks hold the outputs in the order the layout counts them by."""
        err = energy = box_err = weight = 0.0
        for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
            ref, ys = list(ref_chunk.values()), [out_chunk[k] for k in ref_chunk]
            rb, rs, rc = self.layout.candidates(ref)
            yb, ys_, yc = self.layout.candidates(ys)
            err += float(np.sum(np.square(ys_ - rs)))
            energy += float(np.sum(np.square(rs)))
            w = rs.max(axis=2)
            w = np.where(w >= BOX_WEIGHT_FLOOR, w, 0.0)
            size = np.maximum(np.maximum(rb[..., 2] - rb[..., 0], rb[..., 3] - rb[..., 1]), 1.0)
            box_err += float(np.sum(w * np.sum(np.square(yb - rb), axis=2) / np.square(size)))
            if rc is not None:
                box_err += float(np.sum(w * np.mean(np.square(yc - rc), axis=2) / np.maximum(
                    np.mean(np.square(rc), axis=2), 1e-12)))
            weight += float(w.sum())
        return err / max(energy, 1e-30) + box_err / max(weight, 1e-30)


@dataclass(frozen=True)
class SetDetect(Detect):
    """A detector whose outputs are a set of detections (NMS in the graph, or NMS-free; ``tasks.sets``): its sets
    matched to the reference's for the objective, its mAP against the reference's for ``eval``."""

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        return set_discrepancy(self.layout, reference, outputs)


@dataclass(frozen=True)
class HeatDetect(Detect):
    """A CenterNet-style detector (``tasks.maps.HeatLayout``): its heat map's peaks as detections."""

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        return self.layout.discrepancy(reference, outputs)


@dataclass(frozen=True)
class Mask(Task):
    """A binary or salient mask (``tasks.maps.MaskLayout``): the IoU of the binarised masks."""

    layout: MaskLayout = MaskLayout()

    def metric(self) -> Metric:
        return MaskMetric(self.layout)


class DetectionMetric(Metric):
    def __init__(self, task: Detect) -> None:
        self.task = task
        self.vs_ref, self.vs_labels = APAccumulator(), APAccumulator()
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
                self.vs_ref.add(d, Truth(r.boxes, r.classes))
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
            ref = self.vs_ref.result()
            out.update({"mAP50_ref": ref["mAP50"], "mAP50-95_ref": ref["mAP50-95"],
                        "ref_detections": float(self.found), "ref_images_with_objects": float(self.with_objects)})
        if self.vs_labels.truths:
            labels = self.vs_labels.result()
            out.update({"mAP50_labels": labels["mAP50"], "mAP50-95_labels": labels["mAP50-95"]})
        if self.masks is not None and self.compared:
            out["mask_iou_ref"] = self.masks.result()
        return out


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


@dataclass(frozen=True)
class Seq(Task):
    """An attention decoder's per-step class scores ``[N, L, C]``, L varying with the input (a table-structure or
    formula recogniser): its argmax token sequences, each up to its end token (the last class, as PaddleOCR's
    attention heads write it), against the reference's (exact and per token). Named with ``--task seq``: its
    layout is a CTC recogniser's."""

    output: int = 0

    def metric(self) -> Metric:
        return SeqMetric(self)

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        """The squared error of every output over the reference's energy, on the steps up to the end of each of
        the reference's sequences (what a decoder runs past the end is padding), summed over the outputs."""
        err: dict[str, float] = {}
        energy: dict[str, float] = {}
        for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
            scores = list(ref_chunk.values())[self.output]
            steps = _until_end(scores)
            for name, ref in ref_chunk.items():
                ref, y = zero_pad(ref.astype(np.float64), out_chunk[name].astype(np.float64))
                mask = np.zeros(ref.shape[:2], bool)
                if ref.ndim >= 2 and ref.shape[0] == steps.shape[0]:
                    mask[:, : steps.shape[1]] = steps[:, : ref.shape[1]]
                else:
                    mask[:] = True
                err[name] = err.get(name, 0.0) + float(np.sum(np.square(y - ref)[mask]))
                energy[name] = energy.get(name, 0.0) + float(np.sum(np.square(ref)[mask]))
        return sum(err[k] / max(energy[k], 1e-30) for k in err)


def _until_end(scores: np.ndarray) -> np.ndarray:
    """``[N, L]``: True on each sequence's steps up to and including its first end token (the last class)."""
    ended = np.cumsum(scores.argmax(axis=-1) == scores.shape[-1] - 1, axis=1)
    return (ended == 0) | ((ended == 1) & (np.diff(ended, axis=1, prepend=0) == 1))


class SeqMetric(CTCMetric):
    def strings(self, ys: Sequence[np.ndarray]) -> list[tuple[int, ...]]:
        y = ys[self.task.output]
        return [tuple(int(t) for t in row[keep]) for row, keep in zip(y.argmax(axis=-1), _until_end(y))]

    def result(self) -> dict[str, float | None]:
        if not self.total:
            return {}
        return {"sequence_agreement_ref": self.same / self.total,
                "token_agreement_ref": 1.0 - self.edits / max(self.chars, 1)}


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
    return _split_layout(shapes, hw)


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


__all__ = ["TASKS", "CTC", "Detect", "HeatDetect", "Mask", "Metric", "Seq", "SetDetect", "Task", "TextRegions",
           "infer_task", "task_named", "box_iou"]
