"""Ground-truth boxes for ``eval``: a folder of YOLO txt files or a COCO json, placed into the model's input."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from onnxprune.calib.images import Preprocess
from onnxprune.errors import CalibrationError
from onnxprune.tasks.boxes import Truth

MIN_VISIBLE = 0.5  # a box the crop cuts to less than this share of its area is left out


@dataclass
class Labels:
    """Boxes by image file name: xyxy in the image's own pixels, with their classes."""

    source: Path
    boxes: dict[str, tuple[np.ndarray, np.ndarray]]  # file name (yolo: stem) -> (boxes (n, 4), classes (n,))
    by_stem: bool

    @classmethod
    def load(cls, path: str | Path, images: Sequence[Path] = ()) -> Labels:
        """A folder of ``<image stem>.txt`` (``class cx cy w h`` per line, normalised) or a COCO json (boxes
        ``[x, y, w, h]`` in pixels; category ids are the model's class indices when they run 0..C-1, else they
        are numbered in sorted order, as COCO's 1..90 map to a YOLO model's 80 classes)."""
        path = Path(path)
        if path.is_dir():
            return cls(path, {f.stem: _yolo_file(f) for f in sorted(path.glob("*.txt"))}, by_stem=True)
        if path.suffix.lower() == ".json" and path.is_file():
            return cls(path, _coco(path), by_stem=False)
        raise CalibrationError(f"labels {path}: not a folder of YOLO .txt files nor a COCO .json file",
                               option="labels")

    def for_images(self, paths: Sequence[Path], preprocess: Preprocess | None) -> list[Truth]:
        """Each image's boxes in the model input's pixels (after ``preprocess``'s resize and crop); an image
        without a label file has no objects."""
        out = []
        for p in paths:
            boxes, classes = self.boxes.get(p.stem if self.by_stem else p.name, (np.zeros((0, 4)), np.zeros(0, int)))
            with Image.open(p) as im:
                w, h = im.size
            if self.by_stem:
                boxes = boxes * np.array([w, h, w, h], dtype=np.float64)
            out.append(_place(boxes, classes, w, h, preprocess))
        return out


def _place(boxes: np.ndarray, classes: np.ndarray, w: int, h: int, preprocess: Preprocess | None) -> Truth:
    if preprocess is None:
        return Truth(boxes, classes)
    sx, sy, left, top = preprocess.placement(w, h)
    ch, cw = preprocess.crop_hw or (round(h * sy), round(w * sx))
    moved = boxes * np.array([sx, sy, sx, sy]) - np.array([left, top, left, top])
    clipped = np.clip(moved, 0, [cw, ch, cw, ch])
    area = np.prod(np.clip(moved[:, 2:] - moved[:, :2], 0, None), axis=1)
    seen = np.prod(np.clip(clipped[:, 2:] - clipped[:, :2], 0, None), axis=1)
    keep = seen >= MIN_VISIBLE * np.maximum(area, 1e-12)
    return Truth(clipped[keep], classes[keep])


def _yolo_file(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    try:
        values = np.array([[float(v) for v in r[:5]] for r in rows], dtype=np.float64).reshape(-1, 5)
    except ValueError:
        raise CalibrationError(f"{path}: a YOLO label line is 'class cx cy w h' (numbers)", option="labels") from None
    cx, cy, bw, bh = values[:, 1:].T
    return np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], 1), values[:, 0].astype(int)


def _coco(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    try:
        data = json.loads(path.read_text())
        names = {im["id"]: Path(im["file_name"]).name for im in data["images"]}
        ids = sorted({c["id"] for c in data.get("categories", [])} | {a["category_id"] for a in data["annotations"]})
        index = {c: c for c in ids} if ids == list(range(len(ids))) else {c: i for i, c in enumerate(ids)}
        found: dict[str, tuple[list, list]] = {n: ([], []) for n in names.values()}
        for a in data["annotations"]:
            x, y, bw, bh = a["bbox"]
            found[names[a["image_id"]]][0].append([x, y, x + bw, y + bh])
            found[names[a["image_id"]]][1].append(index[a["category_id"]])
    except (ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(f"{path}: not a COCO detection json ({exc!r} missing or wrong): it needs 'images' "
                               "with id and file_name, 'annotations' with image_id, category_id and bbox",
                               option="labels") from None
    return {n: (np.asarray(b, np.float64).reshape(-1, 4), np.asarray(c, int)) for n, (b, c) in found.items()}
