"""The heads read from their outputs' layout beyond anchor grids: post-NMS and NMS-free sets of detections
(``[N, K, 6]`` rows, ``[N, K, 4 + C]`` queries, boxes/scores/classes/count parts), CenterNet heat maps (peaks as
detections) and binary / salient masks. Each metric of a model against itself is 1 and drops when a box (peak, mask)
moves; each objective is 0 against itself and grows with the move; the raw objective weighs outputs equally."""

from __future__ import annotations

import numpy as np
import pytest

from onnxprune.tasks import HeatDetect, Mask, SetDetect, Task, TextRegions, infer_task, raw_discrepancy, task_named

HW = (64, 64)


def _rows(shift: float = 0.0) -> list[np.ndarray]:
    """Two images, 300 slots: x1, y1, x2, y2, score, class (YOLOv10's end-to-end export); 3 objects each."""
    y = np.zeros((2, 300, 6), np.float32)
    y[:, :3, :4] = [[4, 4, 20, 20], [30, 10, 50, 40], [8, 40, 24, 60]]
    y[:, :3, 0::2] += shift
    y[:, :3, 4] = [0.9, 0.8, 0.7]
    y[:, :3, 5] = [0, 2, 1]
    y[:, 3:, 4] = 0.01
    return [y]


def _queries(shift: float = 0.0) -> list[np.ndarray]:
    """RT-DETR: 300 queries of cx, cy, w, h in [0, 1] and 4 class scores."""
    y = np.full((1, 300, 8), 0.01, np.float32)
    y[:, :, :4] = [0.5, 0.5, 0.1, 0.1]
    y[0, 0, :4] = [0.25 + shift / HW[1], 0.25, 0.2, 0.2]
    y[0, 0, 4 + 3] = 0.95
    return [y]


def _parts(shift: float = 0.0) -> list[np.ndarray]:
    """TensorRT-style num_dets [N, 1], boxes [N, K, 4], scores [N, K], classes [N, K]."""
    boxes = np.zeros((1, 100, 4), np.float32)
    boxes[0, :2] = [[4 + shift, 4, 20 + shift, 20], [30, 30, 60, 60]]
    scores = np.zeros((1, 100), np.float32)
    scores[0, :2] = [0.9, 0.6]
    classes = np.zeros((1, 100), np.float32)
    classes[0, :2] = [5, 1]
    return [np.array([[2]], np.int32), boxes, scores, classes]


def _heat(shift: int = 0) -> list[np.ndarray]:
    """CenterFace: a heat map at stride 4, then scale, offset and landmark maps at its resolution."""
    heat = np.zeros((1, 1, 16, 16), np.float32)
    heat[0, 0, 4, 4 + shift] = 0.9
    heat[0, 0, 10, 12] = 0.7
    maps = [np.full((1, c, 16, 16), 2.0, np.float32) for c in (2, 2, 10)]
    return [heat, *maps]


def _mask(shift: int = 0, channels_last: bool = True) -> list[np.ndarray]:
    m = np.zeros((2, 64, 64), np.float32)
    m[:, 10:30, 10 + shift:40 + shift] = 0.95
    return [m[..., None]] if channels_last else [m[:, None], m[:, None] * 0.5]


def _scores(task, ys: list[np.ndarray], refs: list[np.ndarray]) -> dict:
    metric = task.metric()
    metric.update(ys, refs)
    return metric.result()


def _named(outputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {f"y{i}": o for i, o in enumerate(outputs)}


@pytest.mark.parametrize("make, kind", [(_rows, "rows"), (_queries, "queries"), (_parts, "parts")])
def test_a_set_of_detections_is_read_matched_and_scored(make, kind: str) -> None:
    outs = make()
    task = infer_task(outs, HW, len(outs[0]))
    assert isinstance(task, SetDetect) and task.name == "detect" and task.layout.kind == kind
    assert _scores(task, outs, outs)["mAP50-95_ref"] == 1.0
    assert _scores(task, make(shift=3.0), outs)["mAP50-95_ref"] < 1.0
    assert task.discrepancy([_named(outs)], [_named(outs)]) == 0.0
    near = task.discrepancy([_named(outs)], [_named(make(shift=3.0))])
    far = task.discrepancy([_named(outs)], [_named(make(shift=12.0))])
    assert 0.0 < near < far <= 1.0


def test_set_slots_are_matched_not_compared_in_order() -> None:
    """Two sets holding the same detections in another slot order are the same detections."""
    outs = _rows()
    swapped = [outs[0][:, [1, 0, 2, *range(3, 300)]]]
    task = infer_task(outs, HW, 2)
    assert task.discrepancy([{"y": outs[0]}], [{"y": swapped[0]}]) == 0.0


def _faces(shift: float = 0.0, kps: float = 0.0, folded: bool = False) -> list[np.ndarray]:
    """SCRFD at 64²: per stride 8, 16, 32 and two anchors a cell, scores [N, 2·HW, 1], box distances [N, 2·HW, 4]
    and keypoints [N, 2·HW, 10]; one face at stride 8, cell (3, 3), box distances of 1 stride (16..32 px)."""
    rows = [2 * (64 // s) ** 2 for s in (8, 16, 32)]
    outs = [np.full((1, r, 1), 0.01) for r in rows] + [np.ones((1, r, 4)) for r in rows] + [
        np.zeros((1, r, 10)) for r in rows]
    face = (3 * 8 + 3) * 2
    outs[0][0, face] = 0.9
    outs[3][0, face] = [1 + shift / 8, 1 - shift / 8, 1 + shift / 8, 1 + shift / 8]
    outs[6][0, face] = kps
    return [o[0] if folded else o for o in outs]


@pytest.mark.parametrize("folded", [False, True])
def test_a_dense_face_head_is_read_as_a_detector(folded: bool) -> None:
    """SCRFD's nine outputs (per stride: scores, box distances, keypoints; the batch maybe folded into the rows):
    detections placed from each anchor's cell, mAP against itself 1, lower for a moved box; the objective counts
    keypoints where there is a face."""
    outs = _faces(folded=folded)
    task = infer_task(outs, HW, 1)
    assert task.name == "detect" and task.layout.kind == "dense" and task.layout.anchors == 2
    dets = task.layout.decode(outs, 0.25, 0.5)[0]
    np.testing.assert_allclose(dets.boxes, [[16, 16, 32, 32]])
    assert _scores(task, outs, outs)["mAP50-95_ref"] == 1.0
    assert _scores(task, _faces(shift=4.0, folded=folded), outs)["mAP50-95_ref"] < 1.0
    assert task.discrepancy([_named(outs)], [_named(outs)]) == 0.0
    assert task.discrepancy([_named(outs)], [_named(_faces(kps=0.5, folded=folded))]) > 0.0
    assert not isinstance(task, SetDetect)


def test_a_recogniser_per_step_softmax_is_not_a_set_of_boxes() -> None:
    logits = np.random.default_rng(0).normal(size=(2, 40, 97))
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    assert infer_task([probs], (32, 160), 2).name == "ctc"


def test_a_heat_map_peaks_are_detections() -> None:
    outs = _heat()
    task = infer_task(outs, HW, 1)
    assert isinstance(task, HeatDetect) and task.name == "heatmap" and task.layout.stride == 4
    assert task.layout.others == (1, 2, 3)
    dets = task.layout.decode(outs, 0.25, 0.5)[0]
    np.testing.assert_allclose(dets.boxes[0], [18 - 8, 18 - 8, 18 + 8, 18 + 8])
    assert dets.scores.tolist() == pytest.approx([0.9, 0.7])
    assert _scores(task, outs, outs)["mAP50-95_ref"] == 1.0
    assert _scores(task, _heat(shift=1), outs)["mAP50-95_ref"] < 1.0
    assert task.discrepancy([_named(outs)], [_named(outs)]) == 0.0
    assert task.discrepancy([_named(outs)], [_named(_heat(shift=1))]) > 0.0
    sized = _heat()
    sized[3][0, :, 4, 4] = 5.0  # a landmark moves where there is an object
    elsewhere = _heat()
    elsewhere[3][0, :, 0, 15] = 5.0  # the same change where there is none
    assert task.discrepancy([_named(outs)], [_named(sized)]) > 0.0 == task.discrepancy([_named(outs)], [_named(elsewhere)])


def test_masks_are_judged_by_the_iou_of_the_binarised_masks() -> None:
    keras = infer_task(_mask(), HW, 2)
    u2net = infer_task(_mask(channels_last=False), HW, 2)
    assert isinstance(keras, Mask) and keras.layout.channels_last and isinstance(u2net, Mask)
    for task, make in ((keras, _mask), (u2net, lambda shift=0: _mask(shift, channels_last=False))):
        assert _scores(task, make(), make()) == {"mask_iou_ref": 1.0}
        assert _scores(task, make(shift=10), make())["mask_iou_ref"] == pytest.approx(20 / 40)
    metric = keras.metric()
    metric.update(_mask(), _mask())
    metric.update(_mask(shift=10), _mask())
    assert metric.spread()["mask_iou_ref"] > 0.0 and keras.metric().spread() == {}
    one_map = [_mask(channels_last=False)[0]]
    assert isinstance(infer_task(one_map, HW, 2), TextRegions)  # a text detector's map, unless named
    assert isinstance(task_named("mask", one_map, HW, 2), Mask)


def test_the_raw_objective_weighs_every_output_equally() -> None:
    """A 1-channel heat map and a 10-channel landmark map, each 10% off: each adds the same to the objective."""
    rng = np.random.default_rng(0)
    heat, marks = rng.random((2, 1, 8, 8)), 100 * rng.random((2, 10, 8, 8))
    ref = {"heat": heat, "marks": marks}
    assert Task("raw").discrepancy([ref], [{"heat": heat * 1.1, "marks": marks}]) == pytest.approx(0.01)
    assert Task("raw").discrepancy([ref], [{"heat": heat, "marks": marks * 1.1}]) == pytest.approx(0.01)
    assert raw_discrepancy([ref], [{"heat": heat * 1.1, "marks": marks * 1.1}]) == pytest.approx(0.02)


def _nms_free(path) -> None:
    """A tiny detector exported as YOLOv10's end-to-end head: per cell 4 box values and 3 class scores, the best
    class's score and index per cell, TopK over the cells and the chosen rows gathered: ``[1, 10, 6]`` (batch 1,
    as ultralytics exports it)."""
    from onnx import TensorProto, helper, save

    from tests.onnx_builders import GraphBuilder
    b = GraphBuilder({"images": [1, 3, 32, 32]})
    x = b.op("Relu", [b.conv("images", "stem", 3, 16, stride=2)], "stem_act")
    x = b.op("Relu", [b.conv(x, "mid", 16, 16, stride=2)], "mid_act")
    head = b.conv(x, "head", 16, 7)  # [1, 7, 8, 8]
    rows = b.op("Transpose", [b.op("Reshape", [head, b.const("flat", np.array([1, 7, 64]), np.int64)], "flat")],
                "cells", perm=[0, 2, 1])
    box = b.op("Mul", [b.op("Sigmoid", [b.op("Slice", [rows, b.const("s0", np.array([0]), np.int64),
                                                      b.const("s4", np.array([4]), np.int64),
                                                      b.const("ax", np.array([2]), np.int64)], "box_raw")],
                                "box_sig"), b.const("scale", 32.0)], "box")
    cls = b.op("Sigmoid", [b.op("Slice", [rows, "s4", b.const("s7", np.array([7]), np.int64), "ax"], "cls_raw")],
               "cls")
    score = b.op("ReduceMax", [cls], "score", axes=[2], keepdims=1)
    label = b.op("Cast", [b.op("ArgMax", [cls], "label", axis=2, keepdims=1)], "label_f", to=TensorProto.FLOAT)
    xyxy = b.op("Concat", [b.op("Sub", [box, b.const("half", 2.0)], "x1y1"),
                           b.op("Add", [box, "half"], "x2y2")], "xyxy", axis=2)  # [1, 64, 8]: 4 corners used
    table = b.op("Concat", [b.op("Slice", [xyxy, b.const("s0b", np.array([0]), np.int64), "s4", "ax"], "corners"),
                            score, label], "table", axis=2)  # [1, 64, 6]
    flat_score = b.op("Squeeze", [score, b.const("sq", np.array([2]), np.int64)], "flat_score")
    b.nodes.append(helper.make_node("TopK", [flat_score, b.const("k", np.array([10]), np.int64)],
                                    ["top_v", "top_i"], name="topk", axis=1))
    index = b.op("Squeeze", ["top_i", b.const("sq0", np.array([0]), np.int64)], "index")
    out = b.op("Gather", [table, index], "dets", axis=1)
    save(b.model({out: [1, 10, 6]}), str(path))


def test_compress_judges_an_nms_free_head_by_its_detections(tmp_path) -> None:
    import onnxprune
    _nms_free(tmp_path / "e2e.onnx")
    calib = np.random.default_rng(0).random((16, 3, 32, 32)).astype(np.float32)
    result = onnxprune.compress(str(tmp_path / "e2e.onnx"), calib, budget=onnxprune.Ratio(0.7))
    assert result.report.allocation["task"] == "detect"
    assert 0 <= result.report.allocation["with_objects"] <= result.report.allocation["probe_samples"]
    assert result.report.macs_after <= 0.71 * result.report.macs_before
    result.save(tmp_path / "small.onnx")


BRIGHT = [3, 18, 31, 34]  # of 40 samples, those where the dim model's original finds an object


def _dim(tmp_path) -> tuple[str, np.ndarray]:
    """The NMS-free head whose original finds an object only on bright images (values up to 8, not under 1), and
    40 calibration images of which ``BRIGHT`` are bright: on the probing side (sample // 2 odd), none where 4
    evenly spaced probes fall."""
    import onnx
    from onnx import numpy_helper

    _nms_free(tmp_path / "e2e.onnx")
    model = onnx.load(tmp_path / "e2e.onnx")
    bias = next(i for i in model.graph.initializer if i.name == "head.b")
    scores = numpy_helper.to_array(bias).copy()
    scores[4:] = -4.0
    bias.CopyFrom(numpy_helper.from_array(scores, "head.b"))
    onnx.save(model, tmp_path / "dim.onnx")
    calib = (np.random.default_rng(0).random((40, 3, 32, 32)) * 0.3).astype(np.float32)
    calib[BRIGHT] *= 8 / 0.3
    return str(tmp_path / "dim.onnx"), calib


def test_a_detectors_probes_take_the_samples_with_objects_first(tmp_path) -> None:
    """On every sample (--empty-samples): where the evenly spaced probe samples show no object, the probing side's
    samples with one replace them (as many as the probes hold, the count unchanged), and the objects note counts
    the samples they looked at."""
    import onnxprune
    from onnxprune.strategies import Output
    from onnxprune.strategies.sensitivity import objects_seen

    path, calib = _dim(tmp_path)
    result = onnxprune.compress(path, calib, budget=onnxprune.Ratio(0.7), allocate=Output(probe_samples=4),
                                empty_samples=True).report
    report = result.allocation
    assert report["task"] == "detect" and report["probe_samples"] == 4 and report["with_objects"] == 4
    # the note counts where the probes looked (the probing half: 4 of its 20), not the probes they filled
    assert objects_seen(report) == (4, 20)
    assert result.objects is None and result.calibration_samples == 40


def test_a_detector_is_pruned_on_the_samples_where_the_original_finds_objects(tmp_path, monkeypatch) -> None:
    """Of 40 samples, the 4 with an object and 28 of the others, evenly spaced (32 at least), calibrate; the report
    and the printed note count them; the scan reports each chunk it looked through (16 at a time here), of a set
    of 32 too, where every sample is kept."""
    import onnx

    import onnxprune
    from onnxprune.calib.sources import ArraySet
    from onnxprune.pipeline import Compressor
    from onnxprune.strategies import objects, options_from
    from onnxprune.strategies.objects import LEAST, evenly
    from onnxprune.tables import kept_note

    path, calib = _dim(tmp_path)
    monkeypatch.setattr(objects, "SCAN", 16)
    run_ = Compressor(onnx.load(path), ArraySet({"images": calib}, np.arange(40), {"images": np.float32}),
                      options_from(onnxprune.Ratio(0.7), provider="cpu"))
    scanned = []
    run_.keep_objects(lambda done, n: scanned.append((done, n)))
    dim = np.setdiff1d(np.arange(40), BRIGHT)
    kept = np.sort(np.concatenate([BRIGHT, evenly(dim, LEAST - len(BRIGHT))]))
    assert scanned == [(16, 40), (32, 40), (40, 40)] and len(kept) == LEAST == 32
    np.testing.assert_array_equal(run_.inputs["images"], calib[kept])
    assert run_.values_p["images"] is run_.inputs["images"]
    assert (run_.objects.found, run_.objects.samples, run_.objects.kept) == (4, 40, 32)
    report = onnxprune.compress(path, calib, budget=onnxprune.Ratio(0.7)).report
    assert report.objects == {"found": 4, "samples": 40, "kept": 32} and report.calibration_samples == 32
    few = Compressor(onnx.load(path), ArraySet({"images": calib[:LEAST]}, np.arange(LEAST), {"images": np.float32}),
                     options_from(onnxprune.Ratio(0.7), provider="cpu"))
    few.keep_objects(lambda done, n: scanned.append((done, n)))  # no more than 32: every sample is kept, and the
    # original still runs over them, for where it finds objects (the probes read it without running again)
    assert few.objects is None and scanned[3:] == [(16, 32), (32, 32)] and len(few.inputs["images"]) == LEAST
    assert few.found.sum() == sum(i < LEAST for i in BRIGHT)
    assert "objects in 4 of the 40 calibration samples: pruned on those 4 and 28 without" in kept_note(**report.objects)


def test_a_detectors_probes_read_which_kept_samples_show_objects(tmp_path, monkeypatch) -> None:
    """Where the run looked for objects already (more than 32 samples), the probes take the kept samples it found
    objects on without running the original over their half again: of the 32 kept, the bright ones sit at 2, 14,
    24 and 27, three of them on the probing side (sample // 2 odd), where the evenly spaced probes hold one."""
    import onnxprune
    from onnxprune.strategies import Output, sensitivity

    def no_run(*_):
        raise AssertionError("the probes ran the original to look for objects again")

    monkeypatch.setattr(sensitivity, "with_objects", no_run)
    path, calib = _dim(tmp_path)
    report = onnxprune.compress(path, calib, budget=onnxprune.Ratio(0.7), allocate=Output(probe_samples=4)).report
    assert report.calibration_samples == 32 and report.allocation["probe_samples"] == 4
    assert report.allocation["with_objects"] == 3 and tuple(report.allocation["scanned"]) == (3, 16)


def test_a_classifier_keeps_every_calibration_sample_without_running_for_objects(tiny, monkeypatch) -> None:
    """Logits (two axes) are not a detector's: nothing runs, nothing is dropped."""
    from onnxprune.calib.sources import load_calibration
    from onnxprune.ir.ort import model_input_specs
    from onnxprune.pipeline import Compressor
    from onnxprune.strategies import Ratio, objects, options_from

    run_ = Compressor(tiny.model, load_calibration(str(tiny.calib), model_input_specs(tiny.model)),
                      options_from(Ratio(0.6), provider="cpu"))
    assert len(next(iter(run_.inputs.values()))) > objects.LEAST  # enough samples that a detector's would be scanned
    before = run_.inputs
    scanned = []

    def no_run(*_):
        raise AssertionError("the original ran to look for objects")

    monkeypatch.setattr(objects, "outputs", no_run)
    run_.keep_objects(lambda done, n: scanned.append((done, n)))
    assert run_.objects is None and run_.inputs is before and scanned == []
