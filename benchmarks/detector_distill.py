"""A prototype, not in the product: distil a pruned detector from its original on unlabeled images, every weight
from a layer on trained in torch, and follow its held-out mAP50-95 against the original's detections (issue 38).

It asks what ``recover``'s distillation lacks on YOLOv8n: is it the learning rate, the mixup, the loss's scale, or
the weights that train? The loss is ``recovery.objective.DetectLoss`` (``--loss objective``: each batch normalised
by its own teacher energy, as ``recover`` trains) or the same sums over fixed normalisers, the teacher's mean
energy per training image (``--loss fixed``); ``--box-weight`` scales its box term.

    python benchmarks/detectors.py --models yolov8n-320 --ratios 0.7 --variants default,recover \\
        --out benchmarks/results/detectors_recover        # writes the pruned model and the two image folders
    OMP_NUM_THREADS=1 python benchmarks/detector_distill.py --lr 3e-5 --mix none --steps 600 --evals 4

Prints the held-out mAP50-95, mAP50 and objective at the start and at ``--evals`` checkpoints, and a last JSON line.
``--describe A.onnx B.onnx …`` trains nothing: for each pruned model, the held-out mAP50-95, the objective's two
terms, and the IoU of each reference box with the model's best box of its class at score 0.25 (0 where none).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import torch

import onnxprune
from onnxprune.recovery.augment import augment_images
from onnxprune.recovery.objective import DetectLoss
from onnxprune.torch.engine import TorchGraph
from onnxprune.tasks import infer_task
from third_party import wheel_file

RESULTS = Path("benchmarks/results/detectors_recover")


def adam_cosine(params: list[torch.nn.Parameter], lr: float, steps: int):
    """Adam on ``params`` with its cosine decay over ``steps``."""
    opt = torch.optim.Adam(params, lr=lr)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)


def views(train: np.ndarray, batch: int, mix: str, gen: torch.Generator) -> torch.Tensor:
    """A batch drawn from ``train``, cropped, flipped and mixed (``mix`` 'off': as it is)."""
    x = torch.from_numpy(train[torch.randint(len(train), (batch,), generator=gen).numpy()])
    return x if mix == "off" else augment_images(x, gen, mix)


def images(folder: Path, model: onnx.ModelProto, pre: onnxprune.Preprocess) -> np.ndarray:
    return np.concatenate([b["images"] for b in onnxprune.calibration(folder, model, pre).batches(64)])


def layer(name: str) -> int:
    """The ultralytics layer index of an initializer ('model.N.…'), -1 for the others."""
    return int(name.split(".")[1]) if name.startswith("model.") else -1


def iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    lo, hi = np.maximum(box[:2], boxes[:, :2]), np.minimum(box[2:], boxes[:, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=1)
    return inter / (np.prod(box[2:] - box[:2]) + np.prod(boxes[:, 2:] - boxes[:, :2], axis=1) - inter)


def describe(path: Path, held: np.ndarray, t_held: torch.Tensor, task) -> None:
    """A pruned model's held-out mAP50-95, the objective's score and box terms, and its reference boxes' IoUs."""
    with torch.no_grad():
        net = TorchGraph(onnx.load(path))
        ys = torch.cat([net(torch.from_numpy(held[i : i + 32]))[0] for i in range(0, len(held), 32)])
    metric = task.metric()
    metric.update([ys.numpy()], [t_held.numpy()])
    s = DetectLoss(task.layout).sums([ys.double()], [t_held.double()])
    ious = []
    for ref, mine in zip(task.layout.decode([t_held.numpy()], 0.25, 0.5), task.layout.decode([ys.numpy()], 0.25, 0.5)):
        for box, c in zip(ref.boxes, ref.classes):
            same = mine.boxes[mine.classes == c]
            ious.append(float(iou(box, same).max()) if len(same) else 0.0)
    print(f"{path.name}: mAP50-95 {metric.result()['mAP50-95_ref']:.3f}, objective scores {float(s[0] / s[1]):.4f} + "
          f"boxes {float(s[2] / s[3]):.4f}; IoU of the {len(ious)} reference boxes: median {np.median(ious):.3f}, "
          f"none found {np.mean(np.asarray(ious) == 0):.0%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pruned", type=Path, default=RESULTS / "yolov8n-320_0.7_default.onnx")
    p.add_argument("--train", type=Path, default=RESULTS / "yolov8n-320_recover", help="training images")
    p.add_argument("--held", type=Path, default=RESULTS / "yolov8n-320_held", help="held-out images")
    p.add_argument("--loss", choices=["objective", "fixed"], default="objective")
    p.add_argument("--box-weight", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--evals", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mix", choices=["mixup", "none", "off"], default="mixup",
                   help="crop, flip and mixup; crop and flip ('none'); no augmentation ('off')")
    p.add_argument("--from-layer", type=int, default=5, help="train the weights of this layer and those after it")
    p.add_argument("--describe", type=Path, nargs="+", help="pruned models to describe (nothing trains)")
    a = p.parse_args()
    torch.manual_seed(0)
    teacher = onnxprune.load(wheel_file("nudenet", "320n.onnx"), ["1x3x320x320"])
    pre = onnxprune.preprocess_for(teacher, input_shape=["1x3x320x320"], mean=(0, 0, 0), std=(1, 1, 1))
    train, held = images(a.train, teacher, pre), images(a.held, teacher, pre)
    t_net, s_net = TorchGraph(teacher), TorchGraph(onnx.load(a.pruned))
    t_net.requires_grad_(False)
    with torch.no_grad():
        t_held = torch.cat([t_net(torch.from_numpy(held[i : i + 32]))[0] for i in range(0, len(held), 32)])
    task = infer_task([t_held.numpy()], (320, 320), len(held))
    objective = DetectLoss(task.layout)
    if a.describe:
        for path in a.describe:
            describe(path, held, t_held, task)
        return

    def measure() -> tuple[float, float, float]:
        with torch.no_grad():
            ys = torch.cat([s_net(torch.from_numpy(held[i : i + 32]))[0] for i in range(0, len(held), 32)])
        metric = task.metric()
        metric.update([ys.numpy()], [t_held.numpy()])
        r = metric.result()
        return r["mAP50-95_ref"], r["mAP50_ref"], float(objective([ys.double()], [t_held.double()]))

    params = []
    for name, w in s_net.named_initializers():
        if isinstance(w, torch.nn.Parameter):
            w.requires_grad_(layer(name) >= a.from_layer)
            params += [w] if layer(name) >= a.from_layer else []
    norm = None
    if a.loss == "fixed":
        with torch.no_grad():
            sums = [objective.sums([t], [t]) for t in (t_net(torch.from_numpy(train[i : i + 32]))[0]
                                                          for i in range(0, len(train), 32))]
        norm = (sum(float(s[1]) for s in sums) / len(train), sum(float(s[3]) for s in sums) / len(train))

    def loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        s = objective.sums([y], [t])
        if norm is None:
            return s[0] / s[1].clamp_min(1e-30) + a.box_weight * s[2] / s[3].clamp_min(1e-30)
        return s[0] / (len(y) * norm[0]) + a.box_weight * s[2] / (len(y) * norm[1])

    history = [measure()]
    print(f"{sum(w.numel() for w in params)} weights train; start mAP50-95 {history[0][0]:.3f} mAP50 "
          f"{history[0][1]:.3f} objective {history[0][2]:.4f}", flush=True)
    opt, sched = adam_cosine(params, a.lr, a.steps)
    gen, t0 = torch.Generator().manual_seed(0), time.perf_counter()
    for step in range(1, a.steps + 1):
        x = views(train, a.batch, a.mix, gen)
        with torch.no_grad():
            t = t_net(x)[0]
        value = loss(s_net(x)[0], t)
        opt.zero_grad()
        value.backward()
        opt.step()
        sched.step()
        if step % max(a.steps // a.evals, 1) == 0:
            history.append(measure())
            print(f"step {step}: mAP50-95 {history[-1][0]:.3f} mAP50 {history[-1][1]:.3f} objective "
                  f"{history[-1][2]:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "history": history,
                      "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
