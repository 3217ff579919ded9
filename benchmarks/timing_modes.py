"""How the timing method changes a pruned model's measured speed-up (onnxruntime, CPU).

Times the original MobileNetV2 and one pruned model (`--model`, or the default `compress` at `--target` on the
photos with index % 5 != 0) in five ways, `--repeats` times each with the order alternating:

- alone: one session at a time, onnxruntime's default settings, back-to-back runs (what a deployment sees);
- bench: both sessions, taking turns in blocks of ~50 ms of back-to-back runs after an untimed one, threads
  spinning within a run and stopping when it returns (`onnxprune bench`);
- bench --no-spin: the same with the threads sleeping between nodes;
- rounds, sleeping: one run of each per turn, threads sleeping (what `onnxprune bench` did before);
- rounds, spinning: one run of each per turn, threads spinning (onnxruntime's default) between runs too.

Writes `<out>/timing_modes.json` and `<out>/timing_modes.md`.

    python benchmarks/timing_modes.py --target 170M --out benchmarks/results/timing_modes
    python benchmarks/timing_modes.py --quick    # tiny run (a 245M model from 16 photos, batch 1), for the tests
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from common import DEFAULT_DATA, compress, original_model
from onnxprune.analysis import analyze
from onnxprune.ir.load import load_model
from onnxprune.ir.ort import make_session, model_input_specs
from onnxprune.runtime.timing import BLOCK_SECONDS, random_inputs, time_rounds

# name: (spinning, spin between runs, block seconds, alone)
MODES = {
    "alone": (True, True, 0.0, True),
    "bench": (True, False, BLOCK_SECONDS, False),
    "bench --no-spin": (False, True, BLOCK_SECONDS, False),
    "rounds, sleeping": (False, True, 0.0, False),
    "rounds, spinning": (True, True, 0.0, False),
}


def medians(models: list[Path], batch: int, threads: int | None, runs: int, mode: str) -> list[float]:
    """Median ms of each model timed in ``mode``."""
    spinning, between, block, alone = MODES[mode]
    feeds = []
    for m in models:
        specs = model_input_specs(m)
        feeds.append(random_inputs(specs, {specs[0][0]: [batch, 3, 224, 224]}))
    if alone:
        out = []
        for m, feed in zip(models, feeds):
            session, _ = make_session(m, "cpu", threads)
            out.append(float(np.median(time_rounds([(session, feed)], 10, runs, block_seconds=block))) * 1e3)
            del session
        return out
    sessions = [make_session(m, "cpu", threads, spinning=spinning, spin_between_runs=between)[0] for m in models]
    times = time_rounds(list(zip(sessions, feeds)), 10, runs, block_seconds=block)
    return [float(np.median(t)) * 1e3 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photos to calibrate on (NNN_*.jpg)")
    parser.add_argument("--model", type=Path, help="a pruned model to time (default: build one at --target)")
    parser.add_argument("--target", default="170M")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/timing_modes"))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--runs", default="200,15", help="timed runs per model, per batch size")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, help="intra-op threads (default: onnxruntime's)")
    parser.add_argument("--quick", action="store_true", help="tiny run: a 245M model from 16 photos, batch 1")
    args = parser.parse_args()
    calib = "!0%5"
    if args.quick:
        args.target, args.batches, args.runs, args.repeats, calib = "245M", "1", "3", 1, "0:16"
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    model = args.model
    if model is None:
        model = args.out / f"pruned_{args.target}.onnx"
        compress(original, model, args.data, ["--subset", calib, "--target-flops", args.target])
    mac_ratio = analyze(load_model(original)).macs.total / analyze(load_model(model)).macs.total
    load = os.getloadavg()
    rows = []
    for batch, runs in zip(map(int, args.batches.split(",")), map(int, args.runs.split(","))):
        for mode in MODES:
            speedups, ms = [], []
            for i in range(args.repeats):
                pair = [original, model] if i % 2 == 0 else [model, original]
                o, p = medians(pair, batch, args.threads, runs, mode)
                o, p = (o, p) if i % 2 == 0 else (p, o)
                speedups.append(o / p)
                ms.append((o, p))
            row = {"mode": mode, "batch": batch, "original_ms": float(np.median([o for o, _ in ms])),
                   "model_ms": float(np.median([p for _, p in ms])), "speedup": float(np.median(speedups)),
                   "speedup_min": min(speedups), "speedup_max": max(speedups), "mac_ratio": mac_ratio}
            rows.append(row)
            print(row, file=sys.stderr, flush=True)
    load_after = os.getloadavg()
    (args.out / "timing_modes.json").write_text(json.dumps(
        {"model": str(model), "threads": args.threads, "cpus": os.cpu_count(), "load_average_before": load,
         "load_average_after": load_after, "rows": rows}, indent=2))
    lines = ["| timing | batch | original ms | pruned ms | speed-up (median, range) | speed-up / MAC ratio |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['batch']} | {r['original_ms']:.2f} | {r['model_ms']:.2f} | "
                     f"{r['speedup']:.2f}× ({r['speedup_min']:.2f}–{r['speedup_max']:.2f}) | "
                     f"{r['speedup'] / r['mac_ratio']:.2f} |")
    threads = f"{args.threads} intra-op thread(s)" if args.threads else "onnxruntime's default threads"
    table = "\n".join(lines) + (f"\n\n{model.name}: MAC ratio {mac_ratio:.2f}×. {os.cpu_count()} CPUs, {threads}; "
                                f"1-minute load average {load[0]:.1f} before, {load_after[0]:.1f} after.\n")
    (args.out / "timing_modes.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
