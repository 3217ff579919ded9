"""Few-shot recovery on the real ImageNet MobileNetV2: fidelity without and with each recovery variant.

For every MAC target: `compress` (defaults) on the 300 dev photos with index % 5 not in {0, 1},
then `recover` with each variant, trained on the same 300 photos, with the 100 photos index % 5 == 1
(which the pruner did not see) as its held-out set (`--held-subset`), which picks checkpoints and
judges "never worse". Every model is evaluated on the 100 photos index % 5 == 0, which nothing else
saw. For reference, `compress` on all 400 photos (index % 5 != 0) without recovery is also scored.
Writes `<out>/recovery.json` and `<out>/recovery.md` (`--name` changes the stem). `--fold 1` shifts every
set by one fifth (train on index % 5 not in {1, 2}, hold out 2%5, test on 1%5). `--classes k` splits by class
range instead (`common.recover_subsets`): test on the 125 photos of classes 250k to 250k+249, which no photo that
trains shares, as a user's new photos do not. `--recover-every k` gives `recover` only the training photos whose index
is a multiple of k (`compress` still calibrates on all of them): what fewer photos cost. `recovery_pooled.py` pools
several runs.

    python benchmarks/recovery.py --targets 245M,170M --variants "default,block only,distill only"
    python benchmarks/recovery.py --quick        # tiny configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common import (
    DEFAULT_DATA, every_flag, split_flags, split_of, compress, evaluate, macs as count_macs, original_model, recover,
    recover_subsets, thinned,
)

VARIANTS: dict[str, list[str]] = {
    "default": [],
    "block only": ["--method", "block"],
    "distill only": ["--method", "distill"],
    "cutmix": ["--mix", "cutmix"],
    "no mixing": ["--mix", "none"],
    "distill 1200 steps": ["--distill-steps", "1200"],
    "distill lr 3e-4": ["--distill-lr", "3e-4"],
    "distill 4 segments": ["--distill-segments", "4"],
    "distill 1 view": ["--distill-views", "1"],
    "distill whole model": ["--distill-segments", "0", "--distill-steps", "300"],
    "whole network": ["--distill-segments", "0"],
    "colour + both mixes": ["--colour", "0.4", "--mix", "both"],
    "whole share 0.25": ["--whole-share", "0.25"],
    "whole share 0.75": ["--whole-share", "0.75"],
    "average 0.99": ["--average", "0.99"],
    "temperature 4": ["--temperature", "4"],
    "temperature 20": ["--temperature", "20"],
    "features 4": ["--distill-features", "4"],
    "pool 2": ["--pool", "2"],
    "mosaic 0.5": ["--mosaic", "0.5"],
    "leaves 0.5": ["--leaves", "0.5"],
    "steer 0.25": ["--steer", "0.25"],
    "tensor adam": ["--optimizer", "tensor-adam"],
    "changed weights only": ["--train", "changed"],
    "pull to start": ["--pull", "1.0"],
    "lr 3e-3": ["--lr", "3e-3"],
    "100 steps": ["--steps", "100"],
    "500 steps": ["--steps", "500"],
    "30 minutes": ["--time", "30m"],
}


STAGE_KEYS = ("parameters", "held_before", "held_after", "best_step", "seconds", "stopped")  # of each stage's report
DISTILL_KEYS = ("samples", "lr", "lr_trials")  # and of the distillation's: how far it went, at what rate, chosen how


def stages(rep: dict) -> list[dict]:
    """What each stage of a `recover` report did (``STAGE_KEYS``; the distillation's ``DISTILL_KEYS`` too)."""
    out = [{"stage": f"block → {s['end'][0]}", **{k: s[k] for k in STAGE_KEYS}} for s in rep["segments"]]
    if rep["distill"] is not None:
        out.append({"stage": "distill", **{k: rep["distill"][k] for k in STAGE_KEYS + DISTILL_KEYS}})
    return out


def verdicts(rep: dict) -> dict:
    """A `recover` report's metric and agreement, before and after, on the held-out samples that judged and on the
    samples it trained on (what the weights reach where they trained)."""
    return {"held_kl": [rep["before"], rep["after"]],
            "held_agreement": [rep["agreement_before"], rep["agreement_after"]],
            "train_kl": [rep["train_before"], rep["train_after"]],
            "train_agreement": [rep["train_agreement_before"], rep["train_agreement_after"]]}


def markdown(rows: list[dict], original: dict) -> str:
    lines = [
        "| target | recovery | MACs | top-1 | top-5 | agreement | KL | recover s | held-out KL (photos 1%5) |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| – | original | {original['macs'] / 1e6:.1f}M | {original['top1']:.1%} | {original['top5']:.1%} | 100% | 0 "
        "| – | – |",
    ]
    for r in rows:
        held = "–" if r.get("held_kl") is None else f"{r['held_kl'][0]:.3f} → {r['held_kl'][1]:.3f}"
        if r.get("improved") is False:
            held += " (input kept)"
        secs = "–" if r["seconds"] is None else f"{r['seconds']:.0f}"
        lines.append(f"| {r['target']} | {r['variant']} | {r['macs'] / 1e6:.1f}M | {r['top1']:.1%} | {r['top5']:.1%} "
                     f"| {r['agreement']:.1%} | {r['kl']:.3f} | {secs} | {held} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--targets", default="245M,170M")
    parser.add_argument("--variants", default="default", help=f"comma-separated among: {list(VARIANTS)}")
    parser.add_argument("--name", default="recovery", help="stem of the result files")
    split_flags(parser)
    every_flag(parser)
    parser.add_argument("--quick", action="store_true",
                        help="tiny run: 16 calibration, 8 held-out and 10 test photos, 3 steps")
    args = parser.parse_args()
    calib, held, test = recover_subsets(args.fold, args.classes)
    everything = f"!{test}"
    extra: list[str] = []
    if args.quick:
        calib, held, test, everything, args.targets, args.variants, extra = (
            "0:16", "16:24", "100:110", "0:24", "245M", "default", ["--steps", "3", "--distill-steps", "3"])
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)

    base = evaluate(original, original, args.data, test)
    base["macs"] = count_macs(original)
    rows = []
    for target in args.targets.split(","):
        pruned = args.out / f"recovery_{target}.onnx"
        for photos, variant in ((everything, "none, pruned on all but the test photos"), (calib, "none")):
            macs = compress(original, pruned, args.data, ["--subset", photos, "--target-flops", target])["macs_after"]
            rows.append({"target": target, "variant": variant, "macs": macs, "seconds": None,
                         **evaluate(pruned, original, args.data, test)})
            print(markdown(rows[-1:], base).splitlines()[-1], file=sys.stderr, flush=True)
        for variant in args.variants.split(","):
            recovered = args.out / "recovered.onnx"
            start = time.perf_counter()
            rep = recover(pruned, original, recovered, args.data,
                          ["--subset", thinned(calib, args.recover_every), "--held-subset", held, *VARIANTS[variant],
                           *extra])
            wall = time.perf_counter() - start
            rows.append({"target": target, "variant": variant, "flags": VARIANTS[variant], "macs": macs,
                         "recover_samples": rep["samples_given"],
                         "seconds": wall, **verdicts(rep), "improved": rep["improved"],
                         "stages": stages(rep), **evaluate(recovered, original, args.data, test)})
            recovered.unlink()
            print(markdown(rows[-1:], base).splitlines()[-1], file=sys.stderr, flush=True)
        pruned.unlink()
    split = split_of(args.fold, args.classes)
    (args.out / f"{args.name}.json").write_text(json.dumps({"original": base, "split": split, "subsets": [calib, held,
                                                                                                         test],
                                                           "rows": rows}, indent=2))
    table = markdown(rows, base)
    (args.out / f"{args.name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
