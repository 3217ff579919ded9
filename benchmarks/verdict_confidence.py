"""How sure a detector's never-worse verdict was: the share of bootstrap resamples on which a recovered model scores
better than its input, on the verdict samples `recover` split off its calibration folder, and on a folder of images
neither saw.

    python benchmarks/verdict_confidence.py --teacher 320n.onnx --before pruned.onnx --after recovered.onnx \
        --calib CALIB_FOLDER --unseen HELD_FOLDER --input-shape 1x3x320x320 --mean 0,0,0 --std 1,1,1

The verdict samples are those `recover --calib CALIB_FOLDER` judges by (its default split: ``samples.split`` then
``samples.halves``); the metric is the one it judges by (1 − mAP50-95 for a detector).
"""

from __future__ import annotations

import argparse

import numpy as np
import onnxruntime as ort

from onnxprune import api
from onnxprune.recovery import discrepancy, halves, split
from onnxprune.recovery.objective import detect_task
from onnxprune.recovery.verdict import confidence, scores


def images(folder: str, teacher: str, a: argparse.Namespace) -> np.ndarray:
    pre = api.preprocess_for(teacher, input_shape=[a.input_shape], mean=a.mean, std=a.std)
    calib = api.calibration(folder, api.load(teacher, [a.input_shape]), pre)
    return np.concatenate([next(iter(b.values())) for b in calib.batches(32)])


def outputs(model: str, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    runs = [session.run(None, {name: x[i : i + 1]}) for i in range(len(x))]
    return [np.concatenate([r[k] for r in runs]) for k in range(len(runs[0]))]


def report(what: str, x: np.ndarray, a: argparse.Namespace) -> None:
    t, b, r = (outputs(m, x) for m in (a.teacher, a.before, a.after))
    task = detect_task([o[:1] for o in t], [x[:1]])
    metric, before, _ = discrepancy(b, t, task)
    _, after, _ = discrepancy(r, t, task)
    share = confidence(scores(metric, b, t, task), scores(metric, r, t, task), len(x), seed=a.seed)
    print(f"{what}: {len(x)} samples, {metric} {before:.4f} -> {after:.4f}, the recovered model better on "
          f"{share:.1%} of the resamples")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True)
    parser.add_argument("--before", required=True, help="the pruned model recover was given")
    parser.add_argument("--after", required=True, help="the recovered weights")
    parser.add_argument("--calib", required=True, help="the folder recover was given (its verdict samples)")
    parser.add_argument("--unseen", help="a folder of images neither saw")
    parser.add_argument("--input-shape", default="1x3x320x320")
    parser.add_argument("--mean", type=lambda s: tuple(map(float, s.split(","))), default=(0.0, 0.0, 0.0))
    parser.add_argument("--std", type=lambda s: tuple(map(float, s.split(","))), default=(1.0, 1.0, 1.0))
    parser.add_argument("--holdout", type=float, default=0.2, help="recover's --holdout")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    x = images(a.calib, a.teacher, a)
    _, held = split(len(x), a.holdout)
    report("verdict samples", x[halves(held)[1]], a)
    if a.unseen:
        report("unseen images", images(a.unseen, a.teacher, a), a)


if __name__ == "__main__":
    main()
