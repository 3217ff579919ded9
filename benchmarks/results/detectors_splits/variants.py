"""Variants of YOLOv8n 320's compress on the splits of ``detectors.py --splits N --out DIR`` (a prototype: each variant
is a local switch, not an option of the product), and a diagnosis of what its mAP against the original counts.

    python benchmarks/results/detectors_splits/variants.py DIR --variants default,class0.5 --ratios 0.85,0.7 --splits 4
    python benchmarks/results/detectors_splits/variants.py DIR --diagnose MODEL.onnx --split 0

Besides the benchmark's mAP50-95 (``onnxprune.evaluate``) each row gives, on the same held-out photos:
``ignored``, the mAP50-95 with the pruned model's detections that match only an original detection of score in
[0.05, 0.25) (below the reference's threshold) left out, as COCO leaves out detections of its ignored regions;
``pooled``, one AP50-95 over the detections of every class together (not a mean over classes); ``box``, the
objective's box term (absolute edge error in units of size, weighted by the original's score where it is >= 0.05);
``class``, its class term (squared score error over the original's energy). ``--diagnose`` prints one model's AP per
class with the class's reference detections, and its detections scoring >= 0.15 that match no reference detection,
by kind.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

import onnxprune
import onnxprune.strategies.sensitivity as sensitivity
from onnxprune import Output, Ratio
from onnxprune.calib.images import list_images
from onnxprune.tasks import detect, infer_task
from onnxprune.tasks.detection import IOU_THRESHOLDS, APAccumulator, Truth, box_iou, precision_at_recall

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from third_party import wheel_file  # noqa: E402

SHAPE = ["1x3x320x320"]


def class_weighted_judge(weight: float, power: float = 1.0):
    """``Detect.judge`` with its class term times ``weight`` and its box weights raised to ``power``."""
    def judge(self, reference):
        chunks, energy, total = [], 0.0, 0.0
        for ref_chunk in reference:
            rb, rs, _ = self.layout.candidates(list(ref_chunk.values()))
            w = rs.max(axis=2)
            w = np.where(w >= detect.BOX_WEIGHT_FLOOR, w ** power, 0.0)
            size = np.maximum(np.maximum(rb[..., 2] - rb[..., 0], rb[..., 3] - rb[..., 1]), 1.0)
            chunks.append((list(ref_chunk), rb, rs, w, size))
            energy += float(np.sum(np.square(rs)))
            total += float(w.sum())

        def against(outputs):
            err = box_err = 0.0
            for (names, rb, rs, w, size), out in zip(chunks, outputs, strict=True):
                yb, ys, _ = self.layout.candidates([out[k] for k in names])
                err += float(np.sum(np.square(ys - rs)))
                box_err += float(np.sum(w * np.sum(np.abs(yb - rb), axis=2) / size))
            return weight * err / max(energy, 1e-30) + box_err / max(total, 1e-30)
        return against
    return judge


# name -> (switch applied before compress, compress keywords)
VARIANTS = {
    "default": (lambda: None, {}),
    "class0.5": (lambda: setattr(detect.Detect, "judge", class_weighted_judge(0.5)), {}),
    "class0.25": (lambda: setattr(detect.Detect, "judge", class_weighted_judge(0.25)), {}),
    "box-score2": (lambda: setattr(detect.Detect, "judge", class_weighted_judge(1.0, 2.0)), {}),
    "probes16": (lambda: setattr(sensitivity, "PROBE_PASSES", 16), {}),
    "finer": (lambda: None, {"allocate": Output(ratios=(0.875, 0.75, 0.625, 0.5, 0.375, 0.25))}),
    "flip": (lambda: None, {"flip": True}),
}


def folders(out: Path, split: int) -> tuple[Path, Path]:
    tag = "yolov8n-320" if split == 0 else f"yolov8n-320_s{split}"
    return out / f"{tag}_calib", out / f"{tag}_held"


class Held:
    """The held-out photos, the original's outputs on them and the task read from them."""

    def __init__(self, original: str, folder: Path):
        self.pre = onnxprune.preprocess_for(onnxprune.load(original, SHAPE), mean=(0, 0, 0), std=(1, 1, 1))
        self.x = np.stack([self.pre(p) for p in list_images(folder)])
        self.ref = run(original, self.x)
        self.task = infer_task(self.ref, (320, 320), len(self.x))

    def detections(self, ys: list[np.ndarray], conf: float):
        return self.task.layout.decode(ys, conf, 0.5)


def run(model: str, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    chunks = [session.run(None, {name: x[i:i + 1]}) for i in range(len(x))]  # batch 1: any export runs
    return [np.concatenate([c[j] for c in chunks]) for j in range(len(chunks[0]))]


def scores(held: Held, model: str) -> dict[str, float]:
    ys = run(model, held.x)
    dets, refs = held.detections(ys, 0.001), held.detections(held.ref, 0.25)
    near = held.detections(held.ref, 0.05)
    every, kept = APAccumulator(), APAccumulator()
    for d, r, lo in zip(dets, refs, near):
        lo = lo.take(np.flatnonzero(lo.scores < 0.25))
        keep = [i for i, (b, c) in enumerate(zip(d.boxes, d.classes))
                if not (_overlaps(b, lo.boxes[lo.classes == c]) and not _overlaps(b, r.boxes[r.classes == c]))]
        every.add(d, Truth(r.boxes, r.classes))
        kept.add(d.take(np.array(keep, dtype=int)), Truth(r.boxes, r.classes))
    rb, rs, _ = held.task.layout.candidates(held.ref)
    yb, ys_, _ = held.task.layout.candidates(ys)
    w = rs.max(axis=2)
    w = np.where(w >= detect.BOX_WEIGHT_FLOOR, w, 0.0)
    size = np.maximum(np.maximum(rb[..., 2] - rb[..., 0], rb[..., 3] - rb[..., 1]), 1.0)
    return {"mAP50-95": every.result()["mAP50-95"], "mAP50": every.result()["mAP50"],
            "ignored": kept.result()["mAP50-95"], "pooled": _pooled(every),
            "box": float((w * np.abs(yb - rb).sum(axis=2) / size).sum() / w.sum()),
            "class": float(np.square(ys_ - rs).sum() / np.square(rs).sum())}


def _overlaps(box: np.ndarray, others: np.ndarray) -> bool:
    return bool(len(others)) and box_iou(box[None], others)[0].max() >= 0.5


def _pooled(acc: APAccumulator) -> float:
    sc = np.concatenate([s for c in acc.records for s, _ in acc.records[c]])
    tp = np.concatenate([t for c in acc.records for _, t in acc.records[c]], axis=0)
    order, n = np.argsort(-sc, kind="mergesort"), sum(acc.truths.values())
    return float(np.mean([precision_at_recall(tp[order, t], n) for t in range(len(IOU_THRESHOLDS))]))


def diagnose(held: Held, model: str) -> None:
    ys = run(model, held.x)
    acc, kinds = APAccumulator(), {"a class's other box": [], "another class": [], "below the threshold": [],
                                   "background": []}
    for d, r, lo in zip(held.detections(ys, 0.001), held.detections(held.ref, 0.25), held.detections(held.ref, 0.05)):
        acc.add(d, Truth(r.boxes, r.classes))
        for b, c, s in zip(d.boxes, d.classes, d.scores):
            same = r.boxes[r.classes == c]
            if s < 0.15 or _overlaps(b, same):
                continue
            kind = ("a class's other box" if len(same) and box_iou(b[None], same)[0].max() >= 0.1 else
                    "another class" if _overlaps(b, r.boxes) else
                    "below the threshold" if _overlaps(b, lo.boxes[(lo.classes == c) & (lo.scores < 0.25)]) else
                    "background")
            kinds[kind].append(round(float(s), 2))
    for c, n in sorted((c, n) for c, n in acc.truths.items() if n):  # mAP's classes: those with a reference
        scores_ = np.concatenate([s for s, _ in acc.records[c]])
        tp = np.concatenate([t for _, t in acc.records[c]], axis=0)
        order = np.argsort(-scores_, kind="mergesort")
        ap = [precision_at_recall(tp[order, t], n) for t in range(len(IOU_THRESHOLDS))]
        print(f"class {c}: {n} reference detections, AP50 {ap[0]:.2f}, AP50-95 {np.mean(ap):.2f}")
    for kind, found in kinds.items():
        print(f"unmatched, {kind}: {sorted(found, reverse=True)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="detectors.py --splits N --out DIR")
    parser.add_argument("--variants", default="default")
    parser.add_argument("--ratios", default="0.85,0.7")
    parser.add_argument("--splits", type=int, default=4)
    parser.add_argument("--diagnose", help="a model to diagnose instead, on --split's held-out photos")
    parser.add_argument("--split", type=int, default=0)
    a = parser.parse_args()
    original = str(wheel_file("nudenet", "320n.onnx"))
    if a.diagnose:
        diagnose(Held(original, folders(a.out, a.split)[1]), a.diagnose)
        return
    judge = detect.Detect.judge
    for variant in a.variants.split(","):
        switch, kwargs = VARIANTS[variant]
        for split in range(a.splits):
            calib, held_folder = folders(a.out, split)
            held = Held(original, held_folder)
            for ratio in map(float, a.ratios.split(",")):
                detect.Detect.judge, sensitivity.PROBE_PASSES = judge, 4
                switch()
                start = time.perf_counter()
                result = onnxprune.compress(original, str(calib), budget=Ratio(ratio), preprocess=held.pre,
                                            input_shape=SHAPE, **kwargs)
                seconds = time.perf_counter() - start
                path = a.out / f"variant_{variant}_s{split}_{ratio:g}.onnx"
                result.save(path)
                s = scores(held, str(path))
                print(f"| {variant} | {split} | {ratio:g} | {s['mAP50-95']:.3f} | {s['mAP50']:.3f} | {s['ignored']:.3f} | "
                      f"{s['pooled']:.3f} | {s['box']:.4f} | {s['class']:.4f} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
