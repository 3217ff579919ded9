"""Text models: greedy CTC decoding of a recogniser's sequence, and regions of a text detector's probability map."""

from __future__ import annotations

import numpy as np
import torch

from onnxprune.tasks.boxes import box_iou

BINARY_THRESHOLD = 0.3  # DBNet's usual threshold on the probability map
REGION_IOU = 0.5


def ctc_decode(probs: np.ndarray, blank: int = 0) -> list[tuple[int, ...]]:
    """Greedy CTC of (N, T, C) scores: the best class per step, repeats collapsed, blanks dropped."""
    best = probs.argmax(axis=2)
    out = []
    for row in best:
        keep = np.ones(len(row), dtype=bool)
        keep[1:] = row[1:] != row[:-1]
        out.append(tuple(int(c) for c in row[keep & (row != blank)]))
    return out


def edit_distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Levenshtein distance between two sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def regions(prob: np.ndarray, threshold: float = BINARY_THRESHOLD) -> np.ndarray:
    """The xyxy boxes (n, 4) of the 8-connected regions of a (H, W) map above ``threshold``."""
    mask = torch.from_numpy(np.ascontiguousarray(prob > threshold))
    if not mask.any():
        return np.zeros((0, 4))
    h, w = mask.shape
    labels = torch.where(mask, torch.arange(1, h * w + 1, dtype=torch.float64).reshape(h, w), torch.zeros(()))
    while True:  # each region takes the largest label in it, spread one pixel per step
        grown = torch.nn.functional.max_pool2d(labels[None, None], 3, 1, 1)[0, 0] * mask
        if torch.equal(grown, labels):
            break
        labels = grown
    ids = labels.numpy().astype(np.int64)
    ys, xs = np.nonzero(ids)
    uniq, inverse = np.unique(ids[ys, xs], return_inverse=True)
    boxes = np.zeros((len(uniq), 4))
    boxes[:, 0] = np.full(len(uniq), w)
    boxes[:, 1] = np.full(len(uniq), h)
    np.minimum.at(boxes[:, 0], inverse, xs)
    np.minimum.at(boxes[:, 1], inverse, ys)
    np.maximum.at(boxes[:, 2], inverse, xs + 1)
    np.maximum.at(boxes[:, 3], inverse, ys + 1)
    return boxes


def matched_regions(found: np.ndarray, truth: np.ndarray, iou: float = REGION_IOU) -> int:
    """How many regions of ``found`` match one of ``truth`` one-to-one at IoU ≥ ``iou`` (best pairs first)."""
    if not len(found) or not len(truth):
        return 0
    ious = box_iou(found, truth)
    hits = 0
    while ious.size and ious.max() >= iou:
        i, j = np.unravel_index(int(ious.argmax()), ious.shape)
        hits += 1
        ious[i, :], ious[:, j] = -1.0, -1.0
    return hits
