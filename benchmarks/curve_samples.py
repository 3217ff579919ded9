"""The ε allocation's error curves on 128 evenly spaced calibration photos (the default) vs all of them,
with the default selection, on the real MobileNetV2: 2 folds of the dev photos, scored on the held-out fold.

    python benchmarks/curve_samples.py --targets 220M,170M --out benchmarks/results/curve_samples
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import onnxprune
from common import DEFAULT_DATA, original_model
from fidelity import markdown, pool
from onnxprune.flags.parse import parse_macs
from onnxprune.pipeline import compress
from onnxprune.strategies import MACs, options_from


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--targets", default="220M,170M")
    parser.add_argument("--samples", default="128,100000", help="curve_samples values (more than the set: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    model = onnxprune.load(original)
    rows = []
    for target in args.targets.split(","):
        for samples in map(int, args.samples.split(",")):
            folds = []
            for k in range(2):
                calib = onnxprune.calibration(str(args.data), model, subset=f"!{k}%5")
                t0 = time.perf_counter()
                pruned, report = compress(model, calib, options_from(MACs(parse_macs(target)), curve_samples=samples))
                seconds = time.perf_counter() - t0
                score = onnxprune.evaluate(pruned, args.data, original, subset=f"{k}%5").to_dict()
                folds.append({**score, "seconds": seconds, "macs": report.macs_after})
            name = "all samples" if samples >= len(calib) else f"{samples} samples"
            rows.append({"target": target, "variant": f"ε curves on {name}", "macs": folds[0]["macs"],
                         "compress_seconds": sum(f["seconds"] for f in folds) / 2, **pool(folds)})
            print(rows[-1], flush=True)
    reference = pool([onnxprune.evaluate(model, args.data, original, subset=f"{k}%5").to_dict() for k in range(2)])
    original_row = {**reference, "macs": onnxprune.analyze(model).macs.total}
    (args.out / "curve_samples.json").write_text(json.dumps({"original": original_row, "rows": rows}, indent=1))
    (args.out / "curve_samples.md").write_text(markdown(rows, original_row))
    print(markdown(rows, original_row))


if __name__ == "__main__":
    main()
