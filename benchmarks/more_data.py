"""Does a larger calibration set hurt? Fidelity at one target with N random resized crops of the calibration
photos, judged on held-out photos the crops never came from.

    python benchmarks/more_data.py --sizes 500,2000 --target 245M --folds 2 --out benchmarks/results/more_data \\
        -- --memory 1G

For each fold k (held out: the photos with index % 5 == k), the other photos are cropped at random (scale
0.25-1, aspect 3/4-4/3, 256² JPEGs; `speed.random_crops`, seeded by the fold) and `compress` runs on the first
N crops for each N in `--sizes`, plus once on the photos themselves; each model is evaluated on the fold's
held-out photos against the original. Writes `<out>/more_data.json` and `<out>/more_data.md`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from common import DEFAULT_DATA, compress, evaluate, original_model
from speed import random_crops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/more_data"))
    parser.add_argument("--sizes", default="500,2000")
    parser.add_argument("--target", default="245M")
    parser.add_argument("--folds", type=int, default=1)
    parser.add_argument("extra", nargs="*", help="extra compress flags (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    sizes = [int(n) for n in args.sizes.split(",")]
    photos = sorted(args.data.glob("*.jpg"))
    rows = []
    for k in range(args.folds):
        with tempfile.TemporaryDirectory(prefix="onnxprune-more-data-") as tmp:
            calib = Path(tmp) / "photos"
            calib.mkdir()
            for i, photo in enumerate(photos):
                if i % 5 != k:
                    (calib / photo.name).symlink_to(photo.resolve())
            crops = random_crops(calib, Path(tmp) / "crops", max(sizes), seed=k)
            runs = [("photos", calib, len(photos) - len(photos[k::5]))] + [("crops", crops, n) for n in sizes]
            for kind, folder, n in runs:
                pruned = args.out / "pruned.onnx"
                report = compress(original, pruned, folder, ["--limit", str(n), "--target-flops", args.target,
                                                             *args.extra])
                result = evaluate(pruned, original, args.data, f"{k}%5")
                pruned.unlink()
                rows.append({"fold": k, "calibration": kind, "samples": n, "seconds": report["seconds"],
                             "macs": report["macs_after"], **result})
                print(json.dumps(rows[-1]), flush=True)
    (args.out / "more_data.json").write_text(json.dumps({"target": args.target, "flags": args.extra, "rows": rows},
                                                        indent=2))
    table = markdown(rows)
    (args.out / "more_data.md").write_text(table)
    print(table)


def markdown(rows: list[dict]) -> str:
    """Per calibration set, pooled over folds: top-1, agreement and KL on the held-out photos."""
    lines = ["| calibration | samples | folds | top-1 | agreement | KL | compress s (mean) |", "|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["calibration"], r["samples"]) for r in rows))
    for kind, n in keys:
        group = [r for r in rows if (r["calibration"], r["samples"]) == (kind, n)]
        images = sum(r["images"] for r in group)
        mean = {m: sum(r[m] * r["images"] for r in group) / images for m in ("top1", "agreement", "kl")}
        lines.append(f"| {kind} | {n} | {len(group)} | {mean['top1']:.1%} | {mean['agreement']:.1%} | "
                     f"{mean['kl']:.3f} | {sum(r['seconds'] for r in group) / len(group):.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
