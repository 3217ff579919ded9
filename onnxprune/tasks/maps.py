"""Dense maps a model outputs instead of detections or classes: CenterNet-style heat maps (objects as peaks) and
binary or salient masks.

- ``HeatLayout``: a heat map ``[N, C, H/s, W/s]`` in [0, 1], one channel per class (CenterNet, CenterFace: stride 4),
  with the maps that size and place the objects beside it at the same resolution (sizes, offsets, landmarks). Its
  detections are the heat map's peaks (3×3 local maxima), each a box of ``PEAK_CELLS`` cells centred on it: the
  metric judges where the objects are found, not the sizes the other maps give them.
- ``MaskLayout``: a mask ``[N, 1, H, W]`` or ``[N, H, W, 1]`` (a U-Net's binary mask, a salient-object map), judged
  by the IoU of the binarised masks (at 0.5 for probabilities, 0 for logits).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from onnxprune.tasks.base import Metric
from onnxprune.tasks.boxes import Detections, Truth, bootstrap_sd

HEAT_STRIDES = (4, 2, 8)  # the strides a heat map is looked for at, the common one first
PEAK_CELLS = 4  # the side of a peak's box, in cells of the heat map
WEIGHT_FLOOR = 0.05  # the maps beside the heat map count where the reference's heat is at least this


@dataclass(frozen=True)
class HeatLayout:
    """A heat map (output ``heat``, at ``stride``) and the maps beside it (``others``)."""

    hw: tuple[int, int]
    heat: int
    stride: int
    others: tuple[int, ...] = ()
    protos: int | None = None  # no mask prototypes (what ``DetectionMetric`` asks of a layout)

    def decode(self, outputs: Sequence[np.ndarray], conf: float, iou: float) -> list[Detections]:
        """Each image's peaks of score ≥ ``conf``: a box of ``PEAK_CELLS`` cells around each, its channel the class."""
        heat = np.asarray(outputs[self.heat], np.float64)
        padded = np.pad(heat, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
        windows = np.lib.stride_tricks.sliding_window_view(padded, (3, 3), axis=(2, 3))
        peaks = (heat >= windows.max(axis=(-2, -1))) & (heat >= conf)
        half = PEAK_CELLS * self.stride / 2
        out = []
        for i in range(len(heat)):
            c, y, x = np.nonzero(peaks[i])
            cx, cy = (x + 0.5) * self.stride, (y + 0.5) * self.stride
            scores = heat[i, c, y, x]
            order = np.argsort(-scores, kind="stable")
            boxes = np.stack([cx - half, cy - half, cx + half, cy + half], axis=1)
            out.append(Detections(boxes[order], scores[order], c[order].astype(np.int64)))
        return out

    def discrepancy(self, reference: Sequence[Mapping[str, np.ndarray]],
                    outputs: Sequence[Mapping[str, np.ndarray]]) -> float:
        """The heat map's squared error over the reference's energy, plus, averaged over the maps beside it, their
        squared error over their energy where the reference's heat (its best channel) is at least ``WEIGHT_FLOOR``,
        weighted by that heat: where there is an object, its size and place count."""
        sums = np.zeros((1 + len(self.others), 2))
        for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
            names = list(ref_chunk)
            ref_heat = ref_chunk[names[self.heat]].astype(np.float64)
            sums[0] += _squares(out_chunk[names[self.heat]], ref_heat, 1.0)
            w = ref_heat.max(axis=1, keepdims=True)
            w = np.where(w >= WEIGHT_FLOOR, w, 0.0)
            for j, k in enumerate(self.others, 1):
                sums[j] += _squares(out_chunk[names[k]], ref_chunk[names[k]], w)
        terms = sums[:, 0] / np.maximum(sums[:, 1], 1e-30)
        return float(terms[0] + (terms[1:].mean() if len(terms) > 1 else 0.0))


def _squares(y: np.ndarray, ref: np.ndarray, weight: np.ndarray | float) -> tuple[float, float]:
    ref = np.asarray(ref, np.float64)
    return (float(np.sum(weight * np.square(np.asarray(y, np.float64) - ref))),
            float(np.sum(weight * np.square(ref))))


def heat_layout(outputs: Sequence[np.ndarray], hw: tuple[int, int]) -> HeatLayout | None:
    """The first output that is a heat map (4-D, values in [0, 1], at a stride of ``HEAT_STRIDES``) with another 4-D
    output at its resolution beside it, or None."""
    shapes = [o.shape for o in outputs]
    for stride in HEAT_STRIDES:
        size = (-(-hw[0] // stride), -(-hw[1] // stride))
        at = [i for i, s in enumerate(shapes) if len(s) == 4 and tuple(s[2:]) == size]
        for i in at:
            y = np.asarray(outputs[i])
            if len(at) > 1 and shapes[i][1] <= 100 and y.size and y.min() >= 0 and y.max() <= 1:
                return HeatLayout(hw, i, stride, tuple(j for j in at if j != i))
    return None


@dataclass(frozen=True)
class MaskLayout:
    """A binary or salient mask: output ``output``, its one channel first (``[N, 1, H, W]``) or last."""

    output: int = 0
    channels_last: bool = False

    def masks(self, outputs: Sequence[np.ndarray]) -> np.ndarray:
        """The binarised masks ``[N, H, W]``: at 0.5 for probabilities, at 0 for logits."""
        y = np.asarray(outputs[self.output], np.float64)
        y = y[..., 0] if self.channels_last else y[:, 0]
        return y > (0.5 if y.min() >= 0 and y.max() <= 1 else 0.0)


def mask_layout(outputs: Sequence[np.ndarray], hw: tuple[int, int]) -> MaskLayout | None:
    """A mask the size of the input: channels last (``[N, H, W, 1]``, a Keras U-Net), or channels first when several
    outputs are such masks (U²-Net's fused map and side outputs). One ``[N, 1, H, W]`` map alone is a text
    detector's (``TextRegions``) unless named with ``--task mask``."""
    shapes = [tuple(o.shape) for o in outputs]
    if len(shapes[0]) == 4 and shapes[0][1:] == (*hw, 1):
        return MaskLayout(0, channels_last=True)
    if sum(len(s) == 4 and s[1:] == (1, *hw) for s in shapes) > 1 and shapes[0][1:] == (1, *hw):
        return MaskLayout(0)
    return None


class MaskMetric(Metric):
    """The IoU of the model's binarised masks with the reference's, pooled over images (``mask_iou_ref``), and its
    bootstrap standard deviation over the images (``spread``)."""

    def __init__(self, layout: MaskLayout) -> None:
        self.layout = layout
        self.counts: list[tuple[int, int]] = []  # (intersection, union) of each image

    def update(self, ys: Sequence[np.ndarray], refs: Sequence[np.ndarray] | None,
               truths: Sequence[Truth] | None = None) -> None:
        if refs is None:
            return
        for a, b in zip(self.layout.masks(ys), self.layout.masks(refs)):
            self.counts.append((int((a & b).sum()), int((a | b).sum())))

    def result(self) -> dict[str, float | None]:
        return _pooled_iou(self.counts)

    def spread(self) -> dict[str, float]:
        return bootstrap_sd(self.counts, _pooled_iou)


def _pooled_iou(counts: Sequence[tuple[int, int]]) -> dict[str, float | None]:
    """The IoU of the images whose (intersection, union) are ``counts``, pooled: None where every union is empty."""
    inter, union = np.sum(counts, axis=0) if len(counts) else (0, 0)
    return {"mask_iou_ref": float(inter / union) if union else None}
