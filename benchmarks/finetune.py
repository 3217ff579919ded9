"""A user's own fine-tune with labels against `recover`, on the recovery protocol's photos and minutes.

`compress` MobileNetV2 (defaults) on the training photos of a split (``common.recover_subsets``: an index fold or a
class-range split), then the pruned model goes into a plain PyTorch loop (``onnxprune.to_torch``): cross-entropy on
the photos' file-name labels, random resized crops and flips, AdamW with a cosine rate for ``--time``, the
checkpoint with the best top-1 on the held-out photos kept; ``onnxprune.from_torch`` writes it back and `eval` judges
it on the test photos, beside the pruned model. `recover` on the same photos and minutes is recovery.py's row.

    python benchmarks/finetune.py --targets 170M --fold 0 --time 15m --name finetune_f0
    python benchmarks/finetune.py --quick          # tiny configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

import onnxprune
from common import DEFAULT_DATA, split_flags, split_of, compress, evaluate, original_model, recover_subsets
from onnxprune.calib.images import label_from_name, list_images, select
from onnxprune.flags.parse import parse_duration
from onnxprune.recovery.augment import resized_crop_flip


def photos(data: Path, model: Path, subset: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The photos of ``subset`` preprocessed as `compress` reads them (no mirrors), and their labels."""
    images = onnxprune.calibration(str(data), onnxprune.load(model), subset=subset, flip=False)
    x = np.concatenate([feed["input"] for feed in images.batches(64)])
    labels = [label_from_name(p) for p in select(list_images(data), subset)]
    return torch.from_numpy(x), torch.tensor(labels)


def finetune(pruned: Path, out: Path, train: tuple[torch.Tensor, torch.Tensor], held: tuple[torch.Tensor, torch.Tensor],
             seconds: float, lr: float, batch: int, checks: int = 10) -> dict:
    """The user's loop: every weight of the pruned model trained on labelled crops for ``seconds``; the checkpoint
    with the best held-out top-1 (the start included) written to ``out``."""
    module = onnxprune.to_torch(pruned)
    optimiser = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(0)

    def top1() -> float:
        with torch.no_grad():
            return float((module(held[0])[0].argmax(1) == held[1]).float().mean())

    best, best_state, steps, start = top1(), {k: v.clone() for k, v in module.state_dict().items()}, 0, time.monotonic()
    history = [(0.0, best)]
    while (spent := time.monotonic() - start) < seconds:
        for group in optimiser.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * spent / seconds))
        pick = torch.randint(len(train[0]), (batch,), generator=gen)
        logits = module(resized_crop_flip(train[0][pick], gen))[0]
        loss = torch.nn.functional.cross_entropy(logits, train[1][pick], label_smoothing=0.1)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        steps += 1
        if (time.monotonic() - start) >= seconds * (len(history)) / checks:
            history.append((time.monotonic() - start, top1()))
            if history[-1][1] > best:
                best, best_state = history[-1][1], {k: v.clone() for k, v in module.state_dict().items()}
    module.load_state_dict(best_state)
    onnxprune.from_torch(module, like=pruned, out=out, sample={"input": held[0][:2].numpy()})
    return {"steps": steps, "held_top1": history, "best_held_top1": best}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/finetune"))
    parser.add_argument("--targets", default="170M")
    split_flags(parser)
    parser.add_argument("--time", default="15m", help="the fine-tune's wall time (as recover --time)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--name", default="finetune")
    parser.add_argument("--quick", action="store_true", help="tiny run: 16 training, 8 held-out, 10 test photos, 5 s")
    args = parser.parse_args()
    train, held, test = recover_subsets(args.fold, args.classes)
    if args.quick:
        train, held, test, args.targets, args.time = "0:16", "16:24", "100:110", "245M", "5s"
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    rows = []
    for target in args.targets.split(","):
        pruned, tuned = args.out / f"finetune_{target}.onnx", args.out / f"finetune_{target}_tuned.onnx"
        compress(original, pruned, args.data, ["--subset", train, "--target-flops", target])
        rows.append({"target": target, "variant": "none", **evaluate(pruned, original, args.data, test)})
        start = time.perf_counter()
        run = finetune(pruned, tuned, photos(args.data, pruned, train), photos(args.data, pruned, held),
                       parse_duration(args.time), args.lr, args.batch)
        rows.append({"target": target, "variant": "fine-tune with labels", "seconds": time.perf_counter() - start,
                     **run, **evaluate(tuned, original, args.data, test)})
        print(json.dumps({k: rows[-1][k] for k in ("target", "variant", "top1", "agreement", "kl")}), file=sys.stderr)
    split = split_of(args.fold, args.classes)
    (args.out / f"{args.name}.json").write_text(json.dumps({"split": split, "subsets": [train, held, test],
                                                            "args": sys.argv[1:], "rows": rows}, indent=2))
    for r in rows:
        print(f"| {r['target']} | {r['variant']} | {r['top1']:.1%} | {r['agreement']:.1%} | {r['kl']:.3f} |")


if __name__ == "__main__":
    main()
