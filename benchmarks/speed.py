"""Wall time of `onnxprune compress` on the real MobileNetV2 with all dev photos as calibration.

    python benchmarks/speed.py [--data DIR] [--images 500] [--target 245M] [-- extra compress flags]
    python benchmarks/speed.py --baseline "--allocation epsilon" --rounds 2 --out benchmarks/results/speed_vs_epsilon

Prints the total and per-layer times from the report, and writes `<out>/speed.json`. With ``--baseline``,
each round runs compress with those flags and then without them (times drift on a shared machine: the
ratio of the two in the same rounds is the figure to read), and the JSON holds every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import DEFAULT_DATA, original_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--target", default="245M")
    parser.add_argument("--baseline", help="compress flags to time against the defaults, in the same rounds")
    parser.add_argument("--rounds", type=int, default=2, help="with --baseline: rounds of (baseline, default)")
    parser.add_argument("extra", nargs="*", help="extra compress flags (after --)")
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    if args.baseline is None:
        result = run(original, args, args.extra)
        (args.out / "speed.json").write_text(json.dumps(result, indent=2))
        for layer in result["layers"]:
            print(f"{layer['group']:60} {layer['kept']:5}/{layer['channels']:<5} {layer['seconds']:6.1f}s")
        return
    runs: dict[str, list[dict]] = {"baseline": [], "default": []}
    for _ in range(args.rounds):
        runs["baseline"].append(run(original, args, [*shlex.split(args.baseline), *args.extra]))
        runs["default"].append(run(original, args, args.extra))
    median = {k: statistics.median(r["compress_seconds"] for r in v) for k, v in runs.items()}
    summary = {"baseline_flags": args.baseline, "median_seconds": median,
               "ratio": median["default"] / median["baseline"], "runs": runs}
    (args.out / "speed.json").write_text(json.dumps(summary, indent=2))
    print(f"median compress: {median['default']:.1f}s (default) vs {median['baseline']:.1f}s ({args.baseline}): "
          f"{summary['ratio']:.2f}x")


def run(original: Path, args: argparse.Namespace, flags: list[str]) -> dict:
    """One `onnxprune compress` of ``original`` with ``flags``: its report's times and widths."""
    pruned, report = args.out / "speed.onnx", args.out / "speed_report.json"
    cmd = [sys.executable, "-m", "onnxprune", "compress", str(original), "-o", str(pruned), "--calib", str(args.data),
           "--limit", str(args.images), "--target-flops", args.target, "--report", str(report), *flags]
    print("$", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    rep = json.loads(report.read_text())
    pruned.unlink()
    report.unlink()
    result = {
        "flags": flags, "images": rep["calibration_samples"], "target": args.target, "macs_after": rep["macs_after"],
        "compress_seconds": rep["seconds"], "wall_seconds_incl_startup": wall, "provider": rep["provider"],
        "allocation_seconds": (rep.get("allocation") or {}).get("seconds"),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "layers": [{"group": layer["group"], "kept": layer["kept"], "channels": layer["channels"],
                    "seconds": layer["seconds"]} for layer in rep["layers"]],
    }
    print(f"compress: {rep['seconds']:.1f}s for {result['images']} calibration images on {rep['provider']} "
          f"({result['cores']} cores; probing the output allocation: {result['allocation_seconds'] or 0:.1f}s); "
          f"{wall:.1f}s including start-up", flush=True)
    return result

if __name__ == "__main__":
    main()
