"""Wall time of `onnxprune compress` on the real MobileNetV2 with all dev photos as calibration.

    python benchmarks/speed.py [--data DIR] [--images 500] [--target 245M] [-- extra compress flags]
    python benchmarks/speed.py --baseline "--allocation epsilon" --rounds 2 --out benchmarks/results/speed_vs_epsilon
    python benchmarks/speed.py --samples 500,2000,8000 --out benchmarks/results/memory -- --memory 2G

Prints the total and per-layer times from the report, and writes `<out>/speed.json`. With ``--baseline``,
each round runs compress with those flags and then without them (times drift on a shared machine: the
ratio of the two in the same rounds is the figure to read), and the JSON holds every run. With ``--samples``,
compress runs once per count on that many random resized crops of the photos (seeded, written as JPEGs to a
temporary folder, or to ``--crops-dir`` to keep them), and the table gives each run's time per sample and its
peak resident memory (the compress report's: its own high-water mark).
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
import tempfile
import time
from pathlib import Path

import numpy as np

from common import DEFAULT_DATA, original_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--target", default="245M")
    parser.add_argument("--baseline", help="compress flags to time against the defaults, in the same rounds")
    parser.add_argument("--rounds", type=int, default=2, help="with --baseline: rounds of (baseline, default)")
    parser.add_argument("--samples", help="comma-separated calibration set sizes of random resized crops")
    parser.add_argument("--crops-dir", type=Path, help="with --samples: keep the crops here (reused if present)")
    parser.add_argument("extra", nargs="*", help="extra compress flags (after --)")
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    if args.samples:
        sizes = [int(n) for n in args.samples.split(",")]
        with tempfile.TemporaryDirectory(prefix="onnxprune-crops-") as tmp:
            crops = random_crops(args.data, args.crops_dir or Path(tmp), max(sizes))
            results = [run(original, argparse.Namespace(**{**vars(args), "data": crops, "images": n}), args.extra)
                       for n in sizes]
        (args.out / "speed.json").write_text(json.dumps(results, indent=2))
        (args.out / "speed.md").write_text(samples_table(results))
        print(samples_table(results))
        return
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
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    code = child.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)
    rep = json.loads(report.read_text())
    pruned.unlink()
    report.unlink()
    result = {
        "flags": flags, "images": rep["calibration_samples"], "target": args.target, "macs_after": rep["macs_after"],
        "compress_seconds": rep["seconds"], "wall_seconds_incl_startup": wall, "provider": rep["provider"],
        # the process's own peak (its report); wait4's ru_maxrss counts this script's resident size at the spawn
        "peak_rss_bytes": rep["memory"]["peak_rss"],
        "allocation_seconds": (rep.get("allocation") or {}).get("seconds"),
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "layers": [{"group": layer["group"], "kept": layer["kept"], "channels": layer["channels"],
                    "seconds": layer["seconds"]} for layer in rep["layers"]],
    }
    print(f"compress: {rep['seconds']:.1f}s for {result['images']} calibration images on {rep['provider']} "
          f"({result['cores']} cores; probing the output allocation: {result['allocation_seconds'] or 0:.1f}s); "
          f"{wall:.1f}s including start-up", flush=True)
    return result

def random_crops(photos: Path, folder: Path, n: int, size: int = 256, seed: int = 0) -> Path:
    """``n`` random resized crops (scale 0.25-1, aspect 3/4-4/3, ``size``² JPEGs) of the photos, in ``folder``
    (kept if it already holds them)."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    if len(list(folder.glob("*.jpg"))) >= n:
        return folder
    paths = sorted(photos.glob("*.jpg"))
    rng = np.random.default_rng(seed)
    for i in range(n):
        with Image.open(paths[i % len(paths)]) as im:
            im = im.convert("RGB")
            area = im.width * im.height * rng.uniform(0.25, 1.0)
            ratio = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
            w = int(min(im.width, round(np.sqrt(area * ratio))))
            h = int(min(im.height, round(np.sqrt(area / ratio))))
            x, y = int(rng.integers(0, im.width - w + 1)), int(rng.integers(0, im.height - h + 1))
            im.crop((x, y, x + w, y + h)).resize((size, size), Image.BILINEAR).save(folder / f"{i:06d}.jpg",
                                                                                   quality=90)
    return folder


def samples_table(results: list[dict]) -> str:
    """Markdown: time and peak memory by calibration set size, relative to the first (smallest) run."""
    base = results[0]
    lines = ["| samples | compress s | s per sample | vs first | peak RSS | vs first |", "|---|---|---|---|---|---|"]
    for r in results:
        per = r["compress_seconds"] / r["images"]
        lines.append(f"| {r['images']} | {r['compress_seconds']:.1f} | {per:.3f} | "
                     f"{per / (base['compress_seconds'] / base['images']):.2f}× | "
                     f"{r['peak_rss_bytes'] / 2**30:.2f} GiB | {r['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}× |")
    return "\n".join(lines) + f"\n\ncompress flags: {' '.join(results[0]['flags']) or '(defaults)'}\n"


if __name__ == "__main__":
    main()
