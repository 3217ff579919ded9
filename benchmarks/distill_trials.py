"""Why the whole network's distillation stops at its rate trials at 245M: Adam's first steps, the block outputs' loss,
the augmentation, or the photos themselves?

At 245M with `--allocation recover` the distillation's four rate trials (``train.choose_lr``: a constant rate for 5%
of its loop, some 25 steps) each ended above the held-out KL they started from, with and without mixing, so the stage
stopped (the notebook's "245M: the folds with the allocation ..."). Adam's first steps move every weight by about the
rate whatever its gradient's size (the second moment is one batch's), 3.3M weights at once; a warmup of the rate is
the usual remedy. This runs the trials again from one recovered model, each from the same weights and batches, as
``recover``'s whole-model distillation builds them (``distill_stage``: logits' KL plus the block outputs' relative
error, crops, flips and mixup), changing one thing at a time, and scores each on the held-out photos (their KL to the
original, as the trials are judged, on both halves of the held-out photos). Writes ``<out>/<name>.json`` and ``.md``.

    python benchmarks/recovery_allocation.py --target 245M --fold 1 --late-weight 3 --name late3_fold1_245M --keep
    python benchmarks/distill_trials.py --model benchmarks/results/recovery_classes/late3_fold1_245M_recovered.onnx \
        --fold 1 --name trials_fold1_245M
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from common import DEFAULT_DATA, original_model, recover_subsets, split_flags
from onnxprune.cli import flag_values, torch_threads
from onnxprune.flags import jobs
from onnxprune.ir.batch import free_batch
from onnxprune.ir.graph import export_model
from onnxprune.ir.load import import_graph
from onnxprune.ir.shapes import infer_shapes
from onnxprune.normal import untied
from onnxprune.recovery.augment import augment_images
from onnxprune.recovery.objective import with_features
from onnxprune.recovery.samples import discrepancy, samples
from onnxprune.recovery.segments import find_segments
from onnxprune.recovery.train import evaluate_net, kl_loss
from onnxprune.torch.engine import TorchGraph

PLAIN = "no crop, flip or mixing"
# (name, rate, warmup steps, weight of the block outputs' loss, mixing after the crops and flips, or PLAIN)
TRIALS = [("as recover's trial", 3e-6, 0, 1.0, "mixup"), ("as recover's trial", 1e-5, 0, 1.0, "mixup"),
          ("rate warmed up", 3e-6, 25, 1.0, "mixup"), ("rate warmed up", 1e-5, 25, 1.0, "mixup"),
          ("logits only", 3e-6, 0, 0.0, "mixup"), ("logits only, warmed up", 1e-5, 25, 0.0, "mixup"),
          ("no mixing", 3e-6, 0, 1.0, "none"), ("no mixing, warmed up", 1e-5, 25, 1.0, "none"),
          ("the photos as they are", 3e-6, 0, 1.0, PLAIN), ("the photos as they are, warmed up", 1e-5, 25, 1.0, PLAIN)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the recovered (or pruned) model to start from")
    parser.add_argument("--steps", type=int, default=25, help="steps a trial (recover's: 5%% of the loop)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_classes"))
    parser.add_argument("--name", default="trials")
    split_flags(parser)
    args = parser.parse_args()
    calib, held, _ = recover_subsets(args.fold, args.classes)
    original = original_model(args.out)
    job = jobs.recover_job(flag_values("recover", [str(args.model), "--teacher", str(original), "-o", "unused.onnx",
                                                   "--calib", str(args.data), "--subset", calib, "--held-subset",
                                                   held]))
    torch_threads()
    student, teacher = (untied(m) for m in (job.student, job.teacher))
    student, teacher = free_batch(student) or student, free_batch(teacher) or teacher
    s_graph, t_graph = import_graph(student), import_graph(teacher)
    segments = find_segments(s_graph, t_graph)
    model = infer_shapes(export_model(s_graph))
    values, train_idx, picking, judging = samples(job.data, job.held, job.options, job.options.store())
    held_idx = np.concatenate([picking, judging])  # both halves: the trials' effect, not a verdict
    outputs = [o.name for o in model.graph.output]
    anchors = [seg.end[0] for seg in segments[:-1]]
    net = TorchGraph(model, outputs=outputs + anchors)
    t_net = TorchGraph(teacher, outputs=outputs + anchors)
    t_net.requires_grad_(False)
    xs = [values[name] for name in net.input_names]
    batch = job.options.batch_size  # recover's
    teacher_held = evaluate_net(t_net, xs, held_idx, batch, first=len(outputs))
    params = [p for _, p in net.named_initializers() if isinstance(p, torch.nn.Parameter)]
    start = [p.detach().clone() for p in params]

    def held_kl() -> float:
        return discrepancy(evaluate_net(net, xs, held_idx, batch, first=len(outputs)), teacher_held)[1]

    rows = [{"trial": "start", "held_kl": held_kl()}]
    print(rows[0], flush=True)
    for name, lr, warmup, features, mix in TRIALS:
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        gen = torch.Generator().manual_seed(0)
        opt = torch.optim.Adam(params, lr=lr)
        loss = with_features(kl_loss, len(outputs), features)
        begin = time.perf_counter()
        for step in range(1, args.steps + 1):
            for group in opt.param_groups:
                group["lr"] = lr * min(1.0, step / warmup) if warmup else lr
            pick = train_idx[torch.randint(len(train_idx), (batch,), generator=gen).numpy()]
            photos = torch.from_numpy(np.asarray(xs[0][pick]))
            inputs = photos if mix == PLAIN else augment_images(photos, gen, mix)
            with torch.no_grad():
                targets = list(t_net(inputs))
            value = loss(list(net(inputs)), targets)
            opt.zero_grad(set_to_none=True)
            value.backward()
            opt.step()
        rows.append({"trial": name, "lr": lr, "warmup": warmup, "features": features, "mix": mix,
                     "steps": args.steps, "seconds": time.perf_counter() - begin, "held_kl": held_kl()})
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps({"model": args.model.name, "subsets": [calib, held],
                                                            "held_photos": len(held_idx), "rows": rows}, indent=1))
    base = rows[0]["held_kl"]
    table = ["| trial | rate | warmup steps | block outputs' weight | mixing | held-out KL | change |",
             "|---|---|---|---|---|---|---|", f"| start | – | – | – | – | {base:.4f} | – |"]
    table += [f"| {r['trial']} | {r['lr']:.0e} | {r['warmup']} | {r['features']:g} | {r['mix']} | {r['held_kl']:.4f} "
              f"| {r['held_kl'] / base - 1:+.1%} |" for r in rows[1:]]
    (args.out / f"{args.name}.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
