"""Digests of the weights of pruned MobileNetV2s and of YOLOv8n (nudenet's, at 0.85), to show a refactor changes
no pruned model.

Run it at two commits and compare the JSON files (same machine):

    python benchmarks/weights_digest.py --out before.json   # at the old commit
    python benchmarks/weights_digest.py --out after.json    # at the new one
    diff before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
from pathlib import Path

import onnx
from onnx import numpy_helper

import onnxprune
from common import DEFAULT_DATA, original_model
from onnxprune.strategies import L1, Curve, Local, MACs, NoRefit, Ratio, Scale, Uniform

RUNS = {
    "omp245": dict(budget=MACs(245e6)),
    "local245": dict(budget=MACs(245e6), select=Local()),
    "omp170_curve": dict(budget=MACs(170e6), allocate=Curve()),
    "l1_uniform_scale": dict(budget=Ratio(0.7), select=L1(), allocate=Uniform(), reconstruct=Scale()),
    "omp_norefit": dict(budget=Ratio(0.8), reconstruct=NoRefit()),
}
YOLO = "yolov8n_0.85"


def digest(model: onnx.ModelProto) -> str:
    """SHA-256 (16 hex digits) of the initializers' values in name order."""
    h = hashlib.sha256()
    for t in sorted(model.graph.initializer, key=lambda t: t.name):
        h.update(numpy_helper.to_array(t).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--models", type=Path, default=Path("artifacts"), help="where the original is built")
    parser.add_argument("--subset", default="0:64", help="calibration photos")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default=",".join([*RUNS, YOLO]), help="comma-separated names of the runs to digest")
    a = parser.parse_args()
    runs = a.runs.split(",")
    original = original_model(a.models)
    out = {}
    for name in (n for n in RUNS if n in runs):
        r = onnxprune.compress(original, str(a.data), subset=a.subset, **RUNS[name])
        out[name] = [digest(r.model), r.report.macs_after]
        print(name, *out[name], flush=True)
    if YOLO in runs:
        out[YOLO] = yolov8n(a.data, a.subset)
        print(YOLO, *out[YOLO], flush=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")


def yolov8n(data: Path, subset: str) -> list:
    """The digest and MACs of nudenet's YOLOv8n at 0.85 (the detector objective)."""
    yolo = Path(importlib.util.find_spec("nudenet").origin).parent / "320n.onnx"  # YOLOv8n: the detector objective
    r = onnxprune.compress(yolo, str(data), subset=subset, budget=Ratio(0.85), input_shape=["1x3x320x320"],
                           preprocess=onnxprune.preprocess_for(yolo, input_shape=["1x3x320x320"], mean=(0, 0, 0),
                                                              std=(1, 1, 1)))
    return [digest(r.model), r.report.macs_after]


if __name__ == "__main__":
    main()
