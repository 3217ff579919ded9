"""A latency budget against a MAC budget on the real MobileNetV2: the docs' "Latency-aware target" section.

Builds three models on the photos with index % 5 != 0: ``--target-flops 245M``, ``--target-latency
<ratio>x --latency-batch 32`` (the cost table measured here and saved), and the same with ``--allocation
curve`` spending the saved table. Each is scored on the photos with index % 5 == 0 against the original
(``onnxprune eval``), and timed against it with alternating ``onnxprune bench`` calls (as
``latency.py``). The latency rows keep what each compress predicted and measured (its ``--report``).
Writes ``<out>/latency_target.json`` and ``.md``.

    python benchmarks/latency_target.py             # 0.82x: the ratio 245M MACs gave at batch 32
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from common import DEFAULT_DATA, compress, evaluate, original_model
from latency import bench_pair

CALIB, HELD = "!0%5", "0%5"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--ratio", default="0.82", help="latency target as a fraction of the original's")
    parser.add_argument("--repeats", type=int, default=4, help="bench calls per model and batch (order alternates)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "latency_target_models"
    work.mkdir(exist_ok=True)
    original = original_model(args.out)
    table = work / "cost_table_b32.json"
    latency = ["--target-latency", f"{args.ratio}x", "--latency-batch", "32", "--provider", "cpu"]
    variants = {
        "--target-flops 245M": ["--target-flops", "245M"],
        f"--target-latency {args.ratio}x --latency-batch 32": [*latency, "--save-cost-table", str(table)],
        "same + --allocation curve, its cost table": [*latency, "--allocation", "curve", "--cost-table", str(table)],
    }
    load_before = os.getloadavg()
    rows = []
    for i, (name, flags) in enumerate(variants.items()):
        model, report = work / f"model{i}.onnx", work / f"model{i}.json"
        rep = compress(original, model, args.data, ["--subset", CALIB, *flags], report)
        lat = rep["latency"]
        rows.append({
            "variant": name, "flags": flags, "macs": rep["macs_after"], "compress_seconds": rep["seconds"],
            "latency": lat and {k: lat[k] for k in ("target_ms", "predicted_ms", "measured_ms", "original_ms", "met",
                                                    "batch", "table_seconds")},
            "scores": evaluate(model, original, args.data, HELD),
            "bench": [bench_pair(original, model, batch, runs, args.repeats) for batch, runs in ((1, 100), (32, 15))],
        })
    result = {"load_average_before": load_before, "load_average_after": os.getloadavg(), "cpus": os.cpu_count(),
              "original": evaluate(original, original, args.data, HELD), "rows": rows}
    (args.out / "latency_target.json").write_text(json.dumps(result, indent=2))
    text = markdown(result)
    (args.out / "latency_target.md").write_text(text)
    print(text)


def markdown(result: dict) -> str:
    """The accuracy and speed table, then each latency target's prediction and final check."""
    o = result["original"]
    lines = ["| model | MACs | top-1 | agreement | KL | speed-up b=1 (median, range) | speed-up b=32 (median, range) | "
             "MAC ratio | compress s |", "|---|---|---|---|---|---|---|---|---|",
             f"| original | | {o['top1']:.1%} | 100% | 0 | 1 | 1 | 1 | – |"]
    for r in result["rows"]:
        s, (b1, b32) = r["scores"], r["bench"]
        speed = [f"{b['speedup']:.2f}× ({b['speedup_min']:.2f}–{b['speedup_max']:.2f})" for b in (b1, b32)]
        lines.append(f"| {r['variant']} | {r['macs'] / 1e6:.1f}M | {s['top1']:.1%} | {s['agreement']:.1%} | "
                     f"{s['kl']:.3f} | {speed[0]} | {speed[1]} | {b1['mac_ratio']:.2f}× | "
                     f"{r['compress_seconds']:.0f} |")
    lines += ["", "| model | target ms | predicted ms | measured ms (original in the same rounds) | met | "
              "cost table s |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["latency"]:
            lat = r["latency"]
            lines.append(f"| {r['variant']} | {lat['target_ms']:.0f} | {lat['predicted_ms']:.0f} | "
                         f"{lat['measured_ms']:.0f} ({lat['original_ms']:.0f}) | {lat['met']} | "
                         f"{lat['table_seconds']:.0f} |")
    load = result["load_average_before"][0], result["load_average_after"][0]
    lines.append(f"\n{result['cpus']} CPUs; 1-minute load average {load[0]:.1f} before, {load[1]:.1f} after; "
                 f"scores on the photos {HELD} ({o['images']}), calibration on {CALIB}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
