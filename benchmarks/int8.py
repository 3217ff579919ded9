"""Pruning and INT8 together on the real ImageNet MobileNetV2: each fold's pruned model (as `onnxprune compress`
writes it) quantized by `onnxprune quantize` on the same calibration photos, both judged against the original on
the fold's photos the pruner did not see, and timed beside the original (and the original quantized the same way)
with onnxruntime on the CPU at batch 1 and 32.

    python benchmarks/int8.py --targets 245M --folds 2 --out benchmarks/results/int8
    python benchmarks/int8.py --targets 245M --folds 2 --runtime tensorrt --out benchmarks/results/int8_tensorrt

Fold k calibrates (compress and quantize alike) on the dev photos whose index % 5 != k and is judged on those with
index % 5 == k; the table pools the folds (each figure with its spread over the pooled photos). `--runtime
tensorrt` judges the INT8 models with their Q/DQ pairs run in float (`eval --simulate-qdq`), as TensorRT computes.
Writes `<out>/int8.json` and `<out>/int8.md`; the models stay in `<out>/models/`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from common import DEFAULT_DATA, bench, compress, evaluate, original_model, quantize

SCORES = ("top1", "agreement", "kl")


def _pool(results: list[dict]) -> dict:
    """Image-weighted means of ``SCORES`` over the folds, with the spread of the pooled top-1 and agreement."""
    n = sum(r["images"] for r in results)
    pooled = {k: sum(r[k] * r["images"] for r in results) / n for k in SCORES}
    for k in ("top1", "agreement"):
        pooled[f"{k}_sd"] = math.sqrt(pooled[k] * (1 - pooled[k]) / n)
    return {"images": n, **pooled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/int8"))
    parser.add_argument("--targets", default="245M", help="comma-separated MAC targets (compress --target-flops)")
    parser.add_argument("--folds", type=int, default=2)
    parser.add_argument("--runtime", default="onnxruntime", help="quantize --runtime")
    parser.add_argument("--batches", default="1,32", help="bench batch sizes")
    args = parser.parse_args()
    models = args.out / "models"
    models.mkdir(parents=True, exist_ok=True)
    original = original_model(models)
    simulate = ["--simulate-qdq"] if args.runtime == "tensorrt" else []
    rows: dict[str, dict] = {}
    timed: dict[str, Path] = {"original": original}
    for label in ["original", *args.targets.split(",")]:
        per_fold: dict[str, list[dict]] = {"fp32": [], "int8": []}
        reports = []
        for k in range(args.folds):
            calib, held = f"!{k}%5", f"{k}%5"
            name = label.replace(".", "_")
            fp32 = original if label == "original" else models / f"{name}_f{k}.onnx"
            if label != "original" and not fp32.exists():
                compress(original, fp32, args.data, ["--target-flops", label, "--subset", calib, "--quiet"])
            int8 = models / f"{name}_f{k}.int8.onnx"
            reports.append(quantize(fp32, int8, args.data, ["--subset", calib, "--ref", str(original), "--runtime",
                                                            args.runtime, "--quiet"]))
            per_fold["fp32"].append(evaluate(fp32, original, args.data, held))
            per_fold["int8"].append(evaluate(int8, original, args.data, held, simulate))
            if k == 0:
                timed[label] = fp32
                timed[f"{label} INT8"] = int8
        rows[label] = {kind: _pool(results) for kind, results in per_fold.items()}
        rows[label]["quantize"] = [{"method": r["method"], "float_nodes": r["float_nodes"], "rounding": r["rounding"],
                                    "seconds": round(r["seconds"], 1), "reduce_range": r["reduce_range"]}
                                   for r in reports]
    latency = {}
    for batch in args.batches.split(","):
        results = bench(list(timed.values()), ["--batch", batch, "--provider", "cpu", "--quiet"])
        latency[batch] = {label: r["median_ms"] for label, r in zip(timed, results)}
    out = {"runtime": args.runtime, "folds": args.folds, "rows": rows, "latency_ms": latency,
           "timed": {k: str(v) for k, v in timed.items()}}
    (args.out / "int8.json").write_text(json.dumps(out, indent=2))
    lines = [f"INT8 ({args.runtime} layout) beside FP32, {args.folds} folds pooled "
             f"({rows['original']['fp32']['images']} photos the pruner did not see); figures ± one sd over them", "",
             "| model | FP32 top-1 | INT8 top-1 | FP32 agreement | INT8 agreement | INT8 KL | calibration chosen |",
             "|---|---|---|---|---|---|---|"]
    for label, row in rows.items():
        f, q = row["fp32"], row["int8"]
        chosen = ", ".join(f"{r['method']}{' + ends in float' if r['float_nodes'] else ''}"
                           f"{' + gptq' if r.get('rounding') == 'gptq' else ''}" for r in row["quantize"])
        lines.append(f"| {label} | {f['top1']:.1%} ± {f['top1_sd']:.1%} | {q['top1']:.1%} ± {q['top1_sd']:.1%} | "
                     f"{f['agreement']:.1%} | {q['agreement']:.1%} | {q['kl']:.3f} | {chosen} |")
    lines += ["", "Latency, onnxruntime CPU, median ms (speed-up against the original FP32):", "",
              "| model | " + " | ".join(f"batch {b}" for b in latency) + " |", "|---|" + "---|" * len(latency)]
    for label in timed:
        cells = [f"{latency[b][label]:.2f} ({latency[b]['original'] / latency[b][label]:.2f}×)" for b in latency]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    (args.out / "int8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
