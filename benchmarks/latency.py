"""CPU latency of pruned MobileNetV2s vs the original, next to their MAC ratio.

Every pruned model (the `.onnx` files of `--models`, or models built here with the default
`onnxprune compress` at `--targets` on the photos with index % 5 != 0) is timed against the
original with `onnxprune bench --provider cpu` at each batch size: `--repeats` calls, alternating
which model comes first, each at least `--runs` timed runs per model in alternating blocks after the
warm-up (`--no-spin`: with the threads sleeping between nodes). The speed-up of one
call is the original's median / the pruned model's median; the table gives the median speed-up
over the calls and its range. Writes `<out>/latency.json` and `<out>/latency.md`.

    python benchmarks/latency.py                       # build 270M, 245M, 220M, 170M and time them
    python benchmarks/latency.py --models artifacts/   # time the models already in a folder
    python benchmarks/latency.py --extra "--remove-blocks"   # build them with other compress flags
    python benchmarks/latency.py --quick               # tiny configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

import numpy as np

from common import DEFAULT_DATA, bench, compress, original_model


def bench_pair(original: Path, model: Path, batch: int, runs: int, repeats: int, threads: int | None = None,
               spin: bool = True) -> dict:
    """Medians of ``repeats`` alternating `bench` calls of the original and ``model``."""
    calls = []
    for i in range(repeats):
        pair = [original, model] if i % 2 == 0 else [model, original]
        out = bench(pair, ["--provider", "cpu", "--batch", str(batch), "--runs", str(runs),
                           *(["--threads", str(threads)] if threads else []), *([] if spin else ["--no-spin"])])
        by_path = {Path(r["model"]).resolve(): r for r in out}
        calls.append((by_path[original.resolve()], by_path[model.resolve()]))
    speedups = [o["median_ms"] / p["median_ms"] for o, p in calls]
    return {
        "batch": batch, "runs": runs, "repeats": repeats,
        "original_ms": float(np.median([o["median_ms"] for o, _ in calls])),
        "model_ms": float(np.median([p["median_ms"] for _, p in calls])),
        "speedup": float(np.median(speedups)), "speedup_min": min(speedups), "speedup_max": max(speedups),
        "mac_ratio": calls[0][0]["macs"] / calls[0][1]["macs"], "macs": calls[0][1]["macs"],
        "provider": calls[0][1]["provider"],
    }


def markdown(rows: list[dict]) -> str:
    lines = ["| model | MACs | batch | original ms | pruned ms | speed-up (median, range) | MAC ratio | "
             "speed-up / MAC ratio |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['macs'] / 1e6:.1f}M | {r['batch']} | {r['original_ms']:.2f} | "
                     f"{r['model_ms']:.2f} | {r['speedup']:.2f}× ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) | "
                     f"{r['mac_ratio']:.2f}× | {r['speedup'] / r['mac_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photos to calibrate on (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--models", type=Path, help="time the .onnx files of this folder instead of building them")
    parser.add_argument("--targets", default="270M,245M,220M,170M", help="MAC targets to build (without --models)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--runs", default="100,15", help="timed rounds per bench call, per batch size")
    parser.add_argument("--repeats", type=int, default=4, help="bench calls per model and batch (order alternates)")
    parser.add_argument("--threads", type=int, help="intra-op threads of the timings (default: onnxruntime's)")
    parser.add_argument("--no-spin", dest="spin", action="store_false",
                        help="time with the threads sleeping between nodes (bench --no-spin)")
    parser.add_argument("--extra", default="", help="flags added to every compress, e.g. '--remove-blocks'")
    parser.add_argument("--quick", action="store_true", help="tiny run: one 245M model from 16 photos, batch 1")
    args = parser.parse_args()
    calib = "!0%5"
    if args.quick:
        args.targets, args.batches, args.runs, args.repeats, calib = "245M", "1", "3", 2, "0:16"
    batches = [int(b) for b in args.batches.split(",")]
    runs = [int(r) for r in args.runs.split(",")]
    runs = dict(zip(batches, runs if len(runs) == len(batches) else runs[:1] * len(batches)))
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    if args.models:
        models = sorted(p for p in args.models.glob("*.onnx") if p.resolve() != original.resolve()
                        and p.name != original.name)
        if not models:
            sys.exit(f"error: no pruned .onnx file in {args.models}")
    else:
        if not args.data.is_dir():
            sys.exit(f"error: {args.data} is not a folder of photos: pass --data or --models")
        models = []
        for target in args.targets.split(","):
            path = args.out / f"latency_{target}.onnx"
            compress(original, path, args.data, ["--subset", calib, "--target-flops", target, *shlex.split(args.extra)])
            models.append(path)
    load = os.getloadavg()
    rows = []
    for model in models:
        for batch in batches:
            rows.append({"model": model.name, **bench_pair(original, model, batch, runs[batch], args.repeats,
                                                           args.threads, args.spin)})
            print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    if not args.models:
        for model in models:
            model.unlink()
    (args.out / "latency.json").write_text(json.dumps(
        {"load_average_before": load, "load_average_after": load_after, "cpus": os.cpu_count(),
         "threads": args.threads, "spin": args.spin, "rows": rows},
        indent=2))
    threads = f"{args.threads} intra-op thread(s)" if args.threads else "onnxruntime's default threads"
    threads += "" if args.spin else ", sleeping between nodes (--no-spin)"
    table = markdown(rows) + (f"\n{os.cpu_count()} CPUs, {threads}; 1-minute load average {load[0]:.1f} before, "
                              f"{load_after[0]:.1f} after (a load above the CPU count means other jobs "
                              "shared the machine).\n")
    (args.out / "latency.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
