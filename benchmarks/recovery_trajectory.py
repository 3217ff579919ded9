"""The whole-model distillation's checkpoints scored on photos of classes it never saw: does the held-out loss that
chooses its checkpoint (photos of the training classes) bottom out where the unseen classes' fidelity peaks?

``recovery.py``'s protocol (``--classes k`` or ``--fold k``): `compress` (defaults) on the split's training photos,
then `recover` (defaults) on the same photos with its held-out photos choosing checkpoints. At every held-out measure
of the distillation (its start, the end of each learning-rate trial, then the loop's ``--evals`` checks instead of its
5) the student is also scored on the split's test photos against the original: top-1 against the file-name labels,
agreement and KL. The extra scoring (a pass of the test photos a measure) comes out of the stage's time. Writes
``<out>/<name>.json`` and ``.md``.

    python benchmarks/recovery_trajectory.py --target 170M --classes 3 --evals 15 --name trajectory_classes3_170M
    python benchmarks/recovery_trajectory.py --classes 3 --recover-flags "--distill-lr 3e-5" --name trajectory_lr3e-5
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import time
from pathlib import Path

import numpy as np
import onnx
import torch

from common import DEFAULT_DATA, compress, original_model, recover, recover_subsets, split_flags, split_of
from onnxprune.calib.images import Preprocess, label_from_name, list_images, select
from onnxprune.recovery import stages, train
from onnxprune.torch.engine import TorchGraph

BATCH = 32


def logits_of(net: TorchGraph, x: np.ndarray) -> torch.Tensor:
    """The first output of ``net`` on ``x`` (``train.evaluate_net``: in batches, without gradients)."""
    return torch.from_numpy(train.evaluate_net(net, [x], np.arange(len(x)), BATCH, first=1)[0])


def scores(y: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Top-1 against ``labels``, agreement with ``t``'s top class and mean KL(t || y)."""
    return {"top1": float((y.argmax(1) == labels).float().mean()),
            "agreement": float((y.argmax(1) == t.argmax(1)).float().mean()),
            "kl": float(train.row_kl(y, t).mean())}


def markdown(records: list[dict], trials: int) -> str:
    lines = ["| measure | step | s into the stage | held-out KL | test top-1 | test agreement | test KL |",
             "|---|---|---|---|---|---|---|"]
    for k, r in enumerate(records):
        what = "start" if k == 0 else f"trial {k}" if k <= trials else f"check {k - trials}"
        lines.append(f"| {what} | {r['step']} | {r['seconds']:.0f} | {r['held']:.4f} | {r['top1']:.1%} "
                     f"| {r['agreement']:.1%} | {r['kl']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="170M")
    parser.add_argument("--evals", type=int, default=15, help="the distillation loop's held-out checks")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_classes"))
    parser.add_argument("--name", default="trajectory")
    parser.add_argument("--recover-flags", default="", help="more `recover` flags, as one string")
    split_flags(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calib, held, test = recover_subsets(args.fold, args.classes)
    original = original_model(args.out)
    pruned = args.out / f"trajectory_{args.target}.onnx"
    compress(original, pruned, args.data, ["--subset", calib, "--target-flops", args.target])
    photos = select(list_images(args.data), test)
    x = np.stack([Preprocess()(p) for p in photos])
    labels = torch.tensor([label_from_name(p) for p in photos])
    teacher_logits = logits_of(TorchGraph(onnx.load(original)), x)

    records: list[dict] = []
    steps = [0]
    real_distill, real_step, real_loop = stages.distill, train._adam_step, train.train_loop

    def counted(*a, **kw):
        steps[0] += 1
        return real_step(*a, **kw)

    def spied(student, teacher, params, xs, train_idx, held_out, **kw):
        begin, steps[0] = time.monotonic(), 0

        def measured() -> float:
            value = held_out()
            records.append({"step": steps[0], "seconds": time.monotonic() - begin, "held": value,
                            **scores(logits_of(student, x), teacher_logits, labels)})
            print(markdown(records, 0).splitlines()[-1], flush=True)
            return value

        train.train_loop = functools.partial(real_loop, evals=args.evals)  # the distillation's loop alone
        try:
            return real_distill(student, teacher, params, xs, train_idx, measured, **kw)
        finally:
            train.train_loop = real_loop

    stages.distill, train._adam_step = spied, counted
    try:
        rep = recover(pruned, original, args.out / "recovered.onnx", args.data,
                      ["--subset", calib, "--held-subset", held, *shlex.split(args.recover_flags)])
    finally:
        stages.distill, train._adam_step = real_distill, real_step
    (args.out / "recovered.onnx").unlink()
    pruned.unlink()
    trials = len(rep["distill"]["lr_trials"])
    distill = {k: rep["distill"][k] for k in ("samples", "lr", "lr_trials", "best_step", "seconds")}
    result = {"split": split_of(args.fold, args.classes), "subsets": [calib, held, test], "target": args.target,
              "evals": args.evals, "recover_flags": args.recover_flags, "distill": distill,
              "original_top1": scores(teacher_logits, teacher_logits, labels)["top1"], "records": records}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.name}.md").write_text(markdown(records, trials))
    print(markdown(records, trials))


if __name__ == "__main__":
    main()
