"""Task metrics: detection mAP against pycocotools and hand-worked cases, layouts read from outputs, NMS, masks,
CTC strings and text regions; every metric of a model against itself is exactly 1."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from onnxprune.calib.images import Preprocess
from onnxprune.errors import OptionError
from onnxprune.tasks import CTC, Detect, TextRegions, infer_task, task_named
from onnxprune.tasks.boxes import (APAccumulator, DetectionLayout, Detections, Truth, bootstrap_sd, box_iou,
                                       cells, grid_centres, nms)
from onnxprune.tasks.labels import Labels
from onnxprune.tasks.text import ctc_decode, edit_distance, matched_regions, regions


def _coco_map(dets: list[Detections], truths: list[Truth]) -> tuple[float, float]:
    """mAP50 and mAP50-95 by pycocotools' COCOeval (bbox)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    xywh = lambda b: [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]  # noqa: E731
    classes = sorted({int(c) for t in truths for c in t.classes} | {int(c) for d in dets for c in d.classes})
    gt = {"images": [{"id": i} for i in range(len(truths))], "categories": [{"id": c} for c in classes],
          "annotations": [{"id": k + 1, "image_id": i, "category_id": int(c), "bbox": xywh(b), "iscrowd": 0,
                           "area": float((b[2] - b[0]) * (b[3] - b[1]))}
                          for k, (i, b, c) in enumerate((i, b, c) for i, t in enumerate(truths)
                                                        for b, c in zip(t.boxes, t.classes))]}
    res = [{"image_id": i, "category_id": int(c), "bbox": xywh(b), "score": float(s)}
           for i, d in enumerate(dets) for b, c, s in zip(d.boxes, d.classes, d.scores)]
    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO()
        coco.dataset = gt
        coco.createIndex()
        ev = COCOeval(coco, coco.loadRes(res), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[1]), float(ev.stats[0])


def _random_case(rng: np.random.Generator, images: int) -> tuple[list[Detections], list[Truth]]:
    dets, truths = [], []
    for _ in range(images):
        n = int(rng.integers(1, 6))
        xy = rng.uniform(0, 200, (n, 2))
        wh = rng.uniform(10, 80, (n, 2))
        boxes = np.concatenate([xy, xy + wh], 1)
        cls = rng.integers(0, 3, n)
        truths.append(Truth(boxes, cls))
        keep = rng.random(n) < 0.8  # some objects missed, the others jittered, plus false alarms
        jitter = boxes[keep] + rng.normal(0, 4, (int(keep.sum()), 4))
        jitter = np.concatenate([np.minimum(jitter[:, :2], jitter[:, 2:]), np.maximum(jitter[:, :2], jitter[:, 2:])], 1)
        extra = int(rng.integers(0, 3))
        exy = rng.uniform(0, 200, (extra, 2))
        found = np.concatenate([jitter, np.concatenate([exy, exy + 30], 1)])
        dets.append(Detections(found, rng.random(len(found)), np.concatenate([cls[keep], rng.integers(0, 3, extra)])))
    return dets, truths


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_map_equals_pycocotools(seed: int) -> None:
    dets, truths = _random_case(np.random.default_rng(seed), 12)
    acc = APAccumulator()
    for d, t in zip(dets, truths):
        acc.add(d, t)
    ours = acc.result()
    want50, want = _coco_map(dets, truths)
    assert ours["mAP50"] == pytest.approx(want50, abs=1e-9)
    assert ours["mAP50-95"] == pytest.approx(want, abs=1e-9)
    assert 0.1 < ours["mAP50-95"] < ours["mAP50"] < 1.0


def test_map_hand_worked() -> None:
    """Two objects; the best-scored detection hits one (IoU 1), the second a false alarm, the third hits the
    other at IoU 0.6: precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1 → AP50 = (51·1 + 50·2/3)/101."""
    truth = Truth(np.array([[0, 0, 10, 10], [20, 0, 30, 10]], float), np.array([0, 0]))
    det = Detections(np.array([[0, 0, 10, 10], [50, 50, 60, 60], [20, 0, 32.5, 10]], float),
                     np.array([0.9, 0.8, 0.7]), np.array([0, 0, 0]))
    assert box_iou(det.boxes[2:], truth.boxes[1:])[0, 0] == pytest.approx(0.8)
    acc = APAccumulator()
    acc.add(det, truth)
    ap50 = (51 * 1 + 50 * 2 / 3) / 101
    # IoU 0.8: the third detection counts up to the 0.8 threshold (7 of 10), the first always
    ap_hi = (51 * 1 + 0 * 50) / 101
    assert acc.result()["mAP50"] == pytest.approx(ap50)
    assert acc.result()["mAP50-95"] == pytest.approx((7 * ap50 + 3 * ap_hi) / 10)
    empty = APAccumulator()
    empty.add(det, Truth(np.zeros((0, 4)), np.zeros(0, int)))
    assert empty.result() == {"mAP50": None, "mAP50-95": None}


def test_nms_is_class_aware_and_keeps_the_best() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 10, 10], [0, 0, 10, 10], [30, 30, 40, 40]], float)
    keep = nms(boxes, np.array([0.5, 0.9, 0.8, 0.1]), np.array([0, 0, 1, 0]), 0.5)
    assert keep.tolist() == [1, 2, 3]


def _yolov8(rng: np.random.Generator, hw=(64, 64), classes=3, masks=0, n=2) -> list[np.ndarray]:
    a = sum(cells(hw, (8, 16, 32)))
    y = np.zeros((n, 4 + classes + masks, a), np.float32)
    y[:, :2] = rng.uniform(8, 56, (n, 2, a))
    y[:, 2:4] = rng.uniform(4, 20, (n, 2, a))
    y[:, 4:4 + classes] = rng.random((n, classes, a)) ** 8  # mostly background
    y[:, 4 + classes:] = rng.normal(size=(n, masks, a))
    out = [y]
    if masks:
        out.append(rng.normal(size=(n, masks, hw[0] // 4, hw[1] // 4)).astype(np.float32))
    return out


def test_layouts_are_read_from_the_outputs() -> None:
    rng = np.random.default_rng(0)
    assert infer_task([np.zeros((2, 1000))], (224, 224), 2).name == "classify"
    det = infer_task(_yolov8(rng), (64, 64), 2)
    assert isinstance(det, Detect) and det.layout.kind == "channels_first" and det.layout.classes == 3
    seg = infer_task(_yolov8(rng, masks=4), (64, 64), 2)
    assert seg.name == "segment" and (seg.layout.classes, seg.layout.masks, seg.layout.protos) == (3, 4, 1)
    a = sum(cells((64, 64), (8, 16, 32)))
    decoded = np.concatenate([rng.uniform(0, 64, (1, a, 4)), rng.random((1, a, 2))], 2)
    raw = np.concatenate([rng.uniform(-0.5, 1.5, (1, a, 4)), rng.random((1, a, 2))], 2)
    assert infer_task([decoded], (64, 64), 1).layout.grid is None
    assert infer_task([raw], (64, 64), 1).layout.grid == (8, 16, 32)
    levels = cells((64, 48), (8, 16, 32, 64))
    pico = [np.zeros((1, c, 10)) for c in levels] + [np.zeros((1, c, 32)) for c in levels]
    split = infer_task(pico, (64, 48), 1).layout
    assert (split.kind, split.classes, split.reg_max, split.outputs, split.box_outputs) == (
        "split", 10, 7, (0, 1, 2, 3), (4, 5, 6, 7))
    assert isinstance(infer_task([np.zeros((1, 40, 6625))], (48, 320), 1), CTC)
    assert infer_task([np.zeros((40, 1, 6625))], (64, 256), 1).time_major
    assert isinstance(infer_task([np.zeros((2, 1, 64, 64))], (64, 64), 2), TextRegions)
    assert infer_task([np.zeros((2, 7, 5, 5))], (64, 64), 2).name == "raw"
    with pytest.raises(OptionError, match="task 'detect' does not fit"):
        task_named("detect", [np.zeros((2, 1000))], (224, 224), 2)
    assert task_named("raw", _yolov8(rng), (64, 64), 2).name == "raw"


def test_grid_decoding_of_yolox_and_picodet() -> None:
    """A raw YOLOX cell: (offset + cell) · stride, exp(log size) · stride; a PicoDet cell: centre ± the expected
    distance of each side's distribution, times the stride."""
    hw = (32, 32)
    a = sum(cells(hw, (8, 16, 32)))
    y = np.zeros((1, a, 6))
    y[0, 5, :4] = [0.5, 0.25, np.log(2.0), 0.0]  # level 8, cell (x=1, y=1)
    y[0, 5, 4:] = [0.5, 0.8]
    layout = DetectionLayout("anchors_first", hw, 1, grid=(8, 16, 32))
    boxes, scores, _ = layout.candidates([y])
    np.testing.assert_allclose(boxes[0, 5], [12 - 8, 10 - 4, 12 + 8, 10 + 4])
    assert scores[0, 5, 0] == pytest.approx(0.4)
    levels = cells(hw, (8, 16, 32, 64))
    dist = [np.full((1, c, 8), -30.0) for c in levels]
    dist[0][0, 0].reshape(4, 2)[:, 1] = 30.0  # every side at bin 1 (one stride)
    scores = [np.zeros((1, c, 2)) for c in levels]
    pico = DetectionLayout("split", hw, 2, outputs=(0, 1, 2, 3), box_outputs=(4, 5, 6, 7), reg_max=1)
    boxes, _, _ = pico.candidates(scores + dist)
    np.testing.assert_allclose(boxes[0, 0], [4 - 8, 4 - 8, 4 + 8, 4 + 8], atol=1e-9)
    xy, stride = grid_centres(hw, (8, 16), 0.5)
    assert xy.shape == (20, 2) and stride.tolist() == [8] * 16 + [16] * 4


def test_candidates_decode_on_one_torch_thread_and_leave_the_callers_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A few thousand anchors gain nothing from torch's pool, which competes with onnxruntime's threads still
    spinning after the run before (YOLOX's probes: 2.9 s of decoding instead of 0.5 s)."""
    import torch

    seen = []
    exp = torch.exp
    monkeypatch.setattr(torch, "exp", lambda t: seen.append(torch.get_num_threads()) or exp(t))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layout = DetectionLayout("anchors_first", (32, 32), 1, grid=(8, 16, 32))
        layout.candidates([np.zeros((1, sum(cells((32, 32), (8, 16, 32))), 6))])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


def test_every_metric_of_a_model_against_itself_is_one() -> None:
    rng = np.random.default_rng(1)
    outs = _yolov8(rng, masks=4)
    outs[0][:, 4, :3] = 0.9  # a few objects
    seg = infer_task(outs, (64, 64), 2)
    metric = seg.metric()
    metric.update(outs, outs)
    result = metric.result()
    assert result["mAP50_ref"] == result["mAP50-95_ref"] == result["mask_iou_ref"] == 1.0
    ctc = CTC("ctc", time_major=True).metric()
    seq = rng.normal(size=(20, 3, 11))
    ctc.update([seq], [seq])
    assert ctc.result() == {"string_agreement_ref": 1.0, "char_agreement_ref": 1.0}
    maps = np.zeros((2, 1, 32, 32))
    maps[:, :, 4:8, 2:20] = 0.9
    region = TextRegions("textdet").metric()
    region.update([maps], [maps])
    assert region.result() == {"region_f1_ref": 1.0, "ref_regions": 2.0}
    worse = maps.copy()
    worse[1] = 0.0
    region.update([worse], [maps])
    assert region.result()["region_f1_ref"] == pytest.approx(2 * 3 / (3 + 4))


def test_detection_metric_drops_with_moved_boxes() -> None:
    rng = np.random.default_rng(2)
    outs = _yolov8(rng)
    outs[0][:, 4, :20] = 0.9
    moved = [o.copy() for o in outs]
    moved[0][:, 0, :20] += 3.0  # 3 pixels right
    metric = infer_task(outs, (64, 64), 2).metric()
    metric.update(moved, outs)
    result = metric.result()
    assert result["mAP50_ref"] > 0.5 and result["mAP50-95_ref"] < 0.9 * result["mAP50_ref"]


def test_the_spread_over_images_is_that_of_their_bootstrap_resamples() -> None:
    """Two images with one object each, found in place on one and missed on the other: a resample holds the found
    one twice (mAP 1), the missed one twice (0) or one of each (51 of the 101 recall points, 0.505), with chances
    1/4, 1/4, 1/2, so the standard deviation is 0.354; a model scored alike on every image has none."""
    box = np.array([[10.0, 10.0, 50.0, 50.0]])
    truth = Truth(box, np.array([0]))
    found, missed = APAccumulator(), APAccumulator()
    found.add(Detections(box, np.array([0.9]), np.array([0])), truth)
    missed.add(Detections(np.zeros((0, 4)), np.zeros(0), np.zeros(0, dtype=int)), truth)
    assert APAccumulator.pooled([found, missed]).result()["mAP50-95"] == pytest.approx(51 / 101)
    values = np.array([1.0, 51 / 101, 0.0])
    expected = np.sqrt(np.average((values - np.average(values, weights=[1, 2, 1])) ** 2, weights=[1, 2, 1]))
    sd = bootstrap_sd([found, missed], resamples=2000)
    assert sd["mAP50-95"] == pytest.approx(expected, abs=0.02) and sd["mAP50"] == pytest.approx(expected, abs=0.02)
    assert bootstrap_sd([found, found, found]) == {"mAP50": 0.0, "mAP50-95": 0.0}
    assert bootstrap_sd([found]) == {}


def test_a_detectors_scores_come_with_their_spread_over_the_images() -> None:
    """Against itself every resample scores 1 (no spread); with the boxes of one image of two moved, the resamples
    disagree."""
    rng = np.random.default_rng(2)
    outs = _yolov8(rng)
    outs[0][:, 4, :20] = 0.9
    task = infer_task(outs, (64, 64), 2)
    same = task.metric()
    same.update(outs, outs)
    assert same.spread() == {"mAP50_ref": 0.0, "mAP50-95_ref": 0.0}
    moved = [o.copy() for o in outs]
    moved[0][1, 0, :20] += 3.0  # the second image's boxes 3 pixels right
    metric = task.metric()
    metric.update(moved, outs)
    assert metric.spread()["mAP50-95_ref"] > 0.01 and set(metric.spread()) <= set(metric.result())


def test_ctc_and_edit_distance() -> None:
    probs = np.eye(4)[[0, 1, 1, 0, 1, 2, 2, 3, 0]][None]
    assert ctc_decode(probs) == [(1, 1, 2, 3)]
    assert edit_distance((1, 2, 3), (1, 3)) == 1 and edit_distance((), (4, 5)) == 2


def test_regions_are_connected_components() -> None:
    m = np.zeros((10, 12))
    m[1:3, 1:4] = 1.0
    m[3, 4] = 1.0  # diagonal neighbour: same region
    m[6:9, 8:11] = 1.0
    boxes = regions(m)
    assert sorted(boxes.tolist()) == [[1, 1, 5, 4], [8, 6, 11, 9]]
    assert matched_regions(boxes, boxes) == 2 and matched_regions(boxes, np.zeros((0, 4))) == 0


def test_labels_yolo_and_coco_are_placed_like_the_images(tmp_path: Path) -> None:
    Image.new("RGB", (200, 100)).save(tmp_path / "a.jpg")
    (tmp_path / "yolo").mkdir()
    (tmp_path / "yolo" / "a.txt").write_text("2 0.5 0.5 0.2 0.4\n0 0.02 0.5 0.04 0.2\n")
    pre = Preprocess(resize=50, crop=50)  # 200x100 → 100x50, centre crop 50: x' = x/2 − 25
    truth = Labels.load(tmp_path / "yolo").for_images([tmp_path / "a.jpg"], pre)[0]
    np.testing.assert_allclose(truth.boxes, [[15, 15, 35, 35]])  # x 80..120 → 15..35; the second is cropped away
    assert truth.classes.tolist() == [2]
    coco = {"images": [{"id": 7, "file_name": "a.jpg"}], "categories": [{"id": 1}, {"id": 3}],
            "annotations": [{"image_id": 7, "category_id": 3, "bbox": [80, 30, 40, 40]}]}
    (tmp_path / "c.json").write_text(json.dumps(coco))
    truth = Labels.load(tmp_path / "c.json").for_images([tmp_path / "a.jpg"], pre)[0]
    np.testing.assert_allclose(truth.boxes, [[15, 15, 35, 35]])
    assert truth.classes.tolist() == [1]


@pytest.mark.parametrize("package, rel, flags, images", [
    ("nudenet", "320n.onnx", ["--input-shape", "1x3x320x320", "--mean", "0,0,0", "--std", "1,1,1"], "photos"),
    ("ddddocr", "common_det.onnx", ["--mean", "0,0,0", "--std", "0.00392157,0.00392157,0.00392157", "--bgr"], "pages"),
], ids=["YOLOv8n", "YOLOX raw grid, batch 1"])
def test_eval_of_a_real_detector_against_itself_is_map_one(package: str, rel: str, flags: list[str], images: str,
                                                           tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from onnxprune.cli import app
    from tests.onnx_builders import wheel_file

    path = wheel_file(package, rel)
    folder = tmp_path / "images"
    folder.mkdir()
    if images == "photos":  # photos with people in them: nudenet finds its objects there
        dev = Path(__file__).resolve().parents[2] / "shared" / "data" / "imagenet-sample-dev"
        for name in ("000_n01440764_tench.jpg", "004_n01494475_hammerhead.jpg", "008_n01514859_hen.jpg"):
            if not (dev / name).is_file():
                pytest.skip(f"no {name} in {dev}")
            (folder / name).symlink_to(dev / name)
    else:
        for i in range(3):  # characters, what ddddocr's detector finds
            im = Image.new("RGB", (416, 416), (230, 230, 220))
            d = ImageDraw.Draw(im)
            for k in range(5):
                d.text((20 + 70 * k, 60 + 90 * i), "AB7x"[k % 4], fill=(20, 20, 20), font=ImageFont.load_default(size=48))
            im.save(folder / f"page{i}.png")
    result = CliRunner().invoke(app, ["eval", str(path), "--images", str(folder), "--ref", str(path), "--json",
                                      *flags])
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["task"] == "detect"
    assert data["metrics"]["ref_detections"] > 0
    assert data["metrics"]["mAP50_ref"] == data["metrics"]["mAP50-95_ref"] == 1.0
    assert data["spread"] == {"mAP50_ref": 0.0, "mAP50-95_ref": 0.0}  # every resample of the images scores 1


def test_a_detector_counts_the_images_on_which_the_reference_finds_objects() -> None:
    """Per image of every chunk: one with a score of at least ``conf`` somewhere counts, one below it nowhere."""
    rng = np.random.default_rng(3)
    (y,) = _yolov8(rng, n=3)
    y[:, 4:7] = np.minimum(y[:, 4:7], 0.2)  # nothing at the default conf 0.25
    y[1, 5, 17] = y[1, 6, 60] = 0.9  # two objects on one image
    task = infer_task([y], (64, 64), 3)
    assert task.with_objects([{"out": y}]).tolist() == [False, True, False]
    assert task.with_objects([{"out": y[:2]}, {"out": y[1:]}]).tolist() == [False, True, True, False]
    assert task.with_objects([{"out": y[[0, 2]]}]).tolist() == [False, False]


def test_compress_and_recover_advise_images_with_objects_where_most_samples_have_none() -> None:
    from onnxprune.tables import objects_note

    few = objects_note(3, 32, "probe samples")
    assert "objects in 3 of the 32 probe samples" in few and "give it images like those" in few
    half = objects_note(16, 32, "held-out samples")
    assert "16 of the 32 held-out samples" in half and "give it images" in half
    most = objects_note(24, 32, "held-out samples")
    assert "24 of the 32 held-out samples" in most and "give it images" not in most


def test_detection_objective_counts_scores_everywhere_and_boxes_only_on_objects() -> None:
    rng = np.random.default_rng(4)
    (y,) = _yolov8(rng)
    y[:, 4:7] = 0.01  # background: below the objective's floor of 0.05
    y[:, 4, :10] = 0.9  # ten anchors see an object
    det = infer_task([y], (64, 64), 2)
    ref = [{"out": y}]
    assert det.discrepancy(ref, ref) == 0.0
    background = y.copy()
    background[:, :4, 10:] += 5.0  # boxes move where nothing is seen: no cost (the raw L2 would count them)
    assert det.discrepancy(ref, [{"out": background}]) == 0.0
    def moved(by: float) -> float:  # boxes moved by ``by`` of their width where objects are: two edges move
        out = y.copy()
        out[:, 0, :10] += by * y[:, 2, :10]
        return det.discrepancy(ref, [{"out": out}])

    assert moved(0.1) == pytest.approx(2 * 0.1 * np.mean(y[:, 2, :10] / np.maximum(y[:, 2, :10], y[:, 3, :10])),
                                       rel=1e-6)
    assert moved(0.02) == pytest.approx(moved(0.1) / 5, rel=1e-6)  # linear, as 1 - IoU: small errors count
    scored = y.copy()
    scored[:, 5, 20:30] = 0.3  # false alarms: the scores' error counts on every anchor
    energy = 2 * (10 * 0.81 + (3 * y.shape[2] - 10) * 0.0001)
    assert det.discrepancy(ref, [{"out": scored}]) == pytest.approx(2 * 10 * 0.29**2 / energy)


def test_detection_metrics_without_a_reference_are_those_of_the_labels_only() -> None:
    rng = np.random.default_rng(5)
    outs = _yolov8(rng, n=1)
    outs[0][:, 4, :3] = 0.9
    boxes, _, _ = infer_task(outs, (64, 64), 1).layout.candidates(outs)
    metric = infer_task(outs, (64, 64), 1).metric()
    metric.update(outs, None, [Truth(boxes[0, :3], np.zeros(3, int))])
    result = metric.result()
    assert set(result) == {"mAP50_labels", "mAP50-95_labels"} and result["mAP50_labels"] > 0.3
