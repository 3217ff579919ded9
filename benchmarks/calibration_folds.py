"""The default against ``--method l1`` on one model calibrated on several folds of photos, each judged on the same
held-out photos: how much of a single corpus verdict is the calibration fold (notebook, "One calibration fold
decides a near-tie"). Per fold and method: the output rel-L2, KL and top-1 agreement against the original, the groups
the allocation narrowed, and optionally the same on ``--judge-subset`` photos (calibration photos a whole-network
choice between the two results could hold out).

    cd benchmarks; M=results/third_party_models/made/pt_repvgg_like_224_dynamic_op13.onnx
    python calibration_folds.py $M --folds 0:64,200:264,300:364,400:464
    python calibration_folds.py $M --folds 0:48 --judge-subset 48:64
    python calibration_folds.py $M --folds 0:64 --probe-passes 16   # the allocation's probes on more samples
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import DEFAULT_DATA, compress, evaluate
from third_party import mean_rel_l2

from onnxprune.strategies import sensitivity

METHODS = ("omp", "l1")


def scores(model: Path, original: Path, data: Path, subset: str) -> dict:
    s = evaluate(model, original, data, subset)
    return {"rel_l2": mean_rel_l2(s), "kl": s["kl"], "agreement": s["agreement"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--folds", default="0:64,200:264", help="comma-separated calibration subsets")
    parser.add_argument("--eval-subset", default="100:150")
    parser.add_argument("--judge-subset", help="photos to score both results on as well (held calibration photos)")
    parser.add_argument("--ratio", default="0.85", help="--target-ratio")
    parser.add_argument("--probe-passes", type=int, default=sensitivity.PROBE_PASSES,
                        help="the output allocation's probe budget in passes of the calibration set")
    parser.add_argument("--out", type=Path, default=Path("/tmp/calibration_folds"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sensitivity.PROBE_PASSES = args.probe_passes
    rows = []
    for fold in args.folds.split(","):
        row = {"model": args.model.stem, "calib": fold, "probe_passes": args.probe_passes}
        for method in METHODS:
            out = args.out / f"{args.model.stem}_{method}_{fold.replace(':', '-')}.onnx"
            report = compress(args.model, out, args.data, ["--subset", fold, "--target-ratio", args.ratio, "--method",
                                                            method])
            row[method] = {**scores(out, args.model, args.data, args.eval_subset),
                           "probe_samples": report["allocation"]["probe_samples"], "seconds": report["seconds"],
                           "narrowed": {layer["group"]: f"{layer['channels']}->{layer['kept']}"
                                        for layer in report["layers"] if layer["kept"] < layer["channels"]}}
            if args.judge_subset:
                row[method]["judge"] = scores(out, args.model, args.data, args.judge_subset)
        print(json.dumps(row), flush=True)
        rows.append(row)
    (args.out / f"{args.model.stem}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
