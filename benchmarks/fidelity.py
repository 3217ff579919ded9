"""Fidelity vs MACs on the real ImageNet MobileNetV2, no fine-tuning.

For every MAC target and variant (a set of `onnxprune compress` flags) it compresses, evaluates
top-1/top-5, agreement and KL against the original on held-out photos (dev images whose index
% 5 == 0, never used for calibration), and writes `<out>/fidelity.json` and `<out>/fidelity.md`.

    python benchmarks/fidelity.py --data ../shared/data/imagenet-sample-dev
    python benchmarks/fidelity.py --quick          # tiny configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "default": [],
    "local, paper fold": ["--target", "paper", "--reconstruct", "none"],
    "local, scale": ["--reconstruct", "scale"],
    "l1": ["--method", "l1", "--reconstruct", "none"],
    "l1 + refit": ["--method", "l1"],
    "random": ["--method", "random", "--reconstruct", "none"],
}
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-dev"


def run(args: list[str]) -> str:
    print("$", shlex.join(args), file=sys.stderr, flush=True)
    return subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout


def markdown(rows: list[dict], original: dict) -> str:
    lines = [
        "| target | variant | MACs | top-1 | top-5 | agreement | KL | compress s |",
        "|---|---|---|---|---|---|---|---|",
        f"| – | original | {original['macs'] / 1e6:.1f}M | {original['top1']:.1%} | {original['top5']:.1%} "
        "| 100% | 0 | – |",
    ]
    for r in rows:
        lines.append(f"| {r['target']} | {r['variant']} | {r['macs'] / 1e6:.1f}M | {r['top1']:.1%} | {r['top5']:.1%} "
                     f"| {r['agreement']:.1%} | {r['kl']:.3f} | {r['compress_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--targets", default="270M,245M,220M,170M")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated among: {list(VARIANTS)}")
    parser.add_argument("--calib", default="!0%5", help="calibration subset of the sorted photos")
    parser.add_argument("--held-out", default="0%5", help="evaluation subset (disjoint from --calib)")
    parser.add_argument("--extra", default="", help="flags added to every compress, e.g. '--flip'")
    parser.add_argument("--quick", action="store_true", help="tiny run: 16 calibration and 10 held-out photos")
    args = parser.parse_args()
    if args.quick:
        args.calib, args.held_out, args.targets = "0:16", "100:110", "245M"
        args.variants = "default,l1"
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    args.out.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "onnxprune"]
    original = args.out / "mobilenet_v2.onnx"
    if not original.exists():
        run([sys.executable, "-m", "models", "mobilenet_v2", "-o", str(original)])
    ev = ["--images", str(args.data), "--subset", args.held_out, "--ref", str(original), "--json"]
    base = json.loads(run([*cli, "eval", str(original), *ev]))
    base["macs"] = json.loads(run([*cli, "analyze", str(original), "--json"]))["macs"]
    rows = []
    for target in args.targets.split(","):
        for variant in args.variants.split(","):
            flags = VARIANTS[variant] + shlex.split(args.extra)
            stem = f"mbv2_{target}_{variant.replace(' ', '').replace(',', '_').replace('+', '_')}"
            pruned, report = args.out / f"{stem}.onnx", args.out / f"{stem}.json"
            start = time.perf_counter()
            run([*cli, "compress", str(original), "-o", str(pruned), "--calib", str(args.data), "--subset", args.calib,
                 "--target-flops", target, "--report", str(report), *flags])
            seconds = time.perf_counter() - start
            result = json.loads(run([*cli, "eval", str(pruned), *ev]))
            rep = json.loads(report.read_text())
            rows.append({"target": target, "variant": variant, "flags": flags, "macs": rep["macs_after"],
                         "compress_seconds": rep["seconds"], "seconds": seconds, **result})
            pruned.unlink()
    (args.out / "fidelity.json").write_text(json.dumps({"original": base, "rows": rows}, indent=2))
    table = markdown(rows, base)
    (args.out / "fidelity.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
