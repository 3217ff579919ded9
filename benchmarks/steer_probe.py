"""What ``augment.steer`` does to the original MobileNetV2: how often the class drawn for a dev photo becomes the
teacher's top one, with what probability, and what steering costs against one forward pass of the same photos.

Every photo of ``--subset`` is steered (share 1, seed 0); the drawn classes are replayed from the seed. Writes
``<out>/steer_probe.json`` and ``.md``; the figures in ``augment.STEER_SIZE``'s comment and the notebook's "Images
steered towards random classes" come from this run.

    python benchmarks/steer_probe.py --out benchmarks/results/recovery_classes
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import torch

from common import DEFAULT_DATA, original_model
from onnxprune.calib.images import Preprocess, list_images, select
from onnxprune.recovery.augment import STEER_SIZE, STEER_STEPS, steer
from onnxprune.torch.engine import TorchGraph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--subset", default="100:132", help="the dev photos steered (a --subset spec)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    photos = select(list_images(args.data), args.subset)
    x = torch.from_numpy(np.stack([Preprocess()(p) for p in photos]))
    teacher = TorchGraph(onnx.load(original_model(args.out)))
    teacher.requires_grad_(False)
    with torch.no_grad():
        teacher(x)  # warm-up
        t0 = time.perf_counter()
        before = torch.softmax(teacher(x)[0], 1)
        forward = time.perf_counter() - t0
    t0 = time.perf_counter()
    moved = steer(x, lambda v: teacher(v)[0], torch.Generator().manual_seed(0), 1.0)
    seconds = time.perf_counter() - t0
    replay = torch.Generator().manual_seed(0)
    torch.rand(len(x), generator=replay)
    target = torch.randint(before.shape[1], (len(x),), generator=replay)
    with torch.no_grad():
        after = torch.softmax(teacher(moved)[0], 1)
    rows = torch.arange(len(x))
    result = {"photos": len(x), "subset": args.subset, "steps": STEER_STEPS, "size": STEER_SIZE,
              "drawn_class_on_top": int((after.argmax(1) == target).sum()),
              "top_class_changed": int((after.argmax(1) != before.argmax(1)).sum()),
              "drawn_probability_median": float(after[rows, target].median()),
              "drawn_probability_median_before": float(before[rows, target].median()),
              "largest_pixel_change": float((moved - x).abs().max()),
              "steer_seconds": seconds, "forward_seconds": forward, "threads": torch.get_num_threads()}
    (args.out / "steer_probe.json").write_text(json.dumps(result, indent=1))
    md = (f"| photos | steps × size | drawn class on top | top class changed | p(drawn) median, before → after | "
          f"steering s | one forward s |\n|---|---|---|---|---|---|---|\n"
          f"| {len(x)} ({args.subset}) | {STEER_STEPS} × {STEER_SIZE} | {result['drawn_class_on_top']} "
          f"| {result['top_class_changed']} | {result['drawn_probability_median_before']:.5f} → "
          f"{result['drawn_probability_median']:.2f} | {seconds:.2f} | {forward:.2f} |\n")
    (args.out / "steer_probe.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
