"""The main job on a real model: ImageNet MobileNetV2 → 245M MACs, before/after side by side.

Runs the same `onnxprune` commands a user would (each is printed), calibrating on 400 of the dev
photos and evaluating on the other 100 (file index % 5 == 0), then benchmarks both models on CPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

HELD_OUT = "0%5"
CALIB = "!0%5"


def run(*args: str) -> str:
    print("$", shlex.join(args), flush=True)
    done = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, required=True, help="folder of labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("artifacts"))
    parser.add_argument("--target", default="245M", help="MAC budget")
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data (make demo DATA=...)")
    args.out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "onnxprune"]
    original = args.out / "mobilenet_v2.onnx"
    pruned = args.out / f"mobilenet_v2_{args.target}.onnx"
    report = args.out / f"mobilenet_v2_{args.target}.json"
    if not original.exists():
        run(sys.executable, "-m", "models", "mobilenet_v2", "-o", str(original))
    run(*cli, "compress", str(original), "-o", str(pruned), "--calib", str(args.data), "--subset", CALIB,
        "--target-flops", args.target, "--report", str(report))
    rows = {}
    for name, path in (("original", original), ("pruned", pruned)):
        out = run(*cli, "eval", str(path), "--images", str(args.data), "--subset", HELD_OUT, "--ref", str(original),
                  "--json")
        rows[name] = json.loads(out)
    bench = {}
    for batch in (1, 32):
        out = run(*cli, "bench", str(original), str(pruned), "--provider", "cpu", "--batch", str(batch),
                  "--runs", "30" if batch == 1 else "10", "--json")
        bench[batch] = json.loads(out)
    rep = json.loads(report.read_text())
    print()
    print(f"MobileNetV2 (ImageNet weights) pruned to {args.target} MACs; {rep['calibration_samples']} calibration "
          f"photos, evaluated on {rows['original']['images']} other photos, no fine-tuning; "
          f"compress took {rep['seconds']:.0f}s on {rep['provider']}")
    print(f"{'':10}{'MACs':>10}{'params':>10}{'top-1':>8}{'top-5':>8}{'agree':>8}{'KL':>8}"
          f"{'ms@b1':>9}{'ms@b32':>9}")
    for k, name in enumerate(("original", "pruned")):
        r = rows[name]
        b1, b32 = bench[1][k], bench[32][k]
        print(f"{name:10}{b1['macs'] / 1e6:>9.1f}M{b1['params'] / 1e6:>9.2f}M{r['top1']:>8.1%}{r['top5']:>8.1%}"
              f"{r['agreement']:>8.1%}{r['kl']:>8.3f}{b1['median_ms']:>9.2f}{b32['median_ms']:>9.1f}")
    speed = bench[32][0]["median_ms"] / bench[32][1]["median_ms"]
    ratio = bench[32][0]["macs"] / bench[32][1]["macs"]
    print(f"CPU speed-up at batch 32: {speed:.2f}x for a MAC ratio of {ratio:.2f}x")


if __name__ == "__main__":
    main()
