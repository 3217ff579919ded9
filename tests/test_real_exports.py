"""Graphs as real third-party exports write them, built in code: the batch fixed inside the graph, shapes
the exporter computes, narrow groups against ``--round-to``, and squeeze-excite gates.

The oracle is exactness: the channels a test removes are dead (zero weights and bias), so the pruned model
must reproduce the original's outputs in onnxruntime; a wrong slice, a mixed batch or a stale gate shows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from onnx_graphsurgeon.ir.tensor import LazyValues

from onnxprune.budget.allocation import group_step
from onnxprune.analysis import analyze, consumers
from onnxprune.ir.inputs import specialise_inputs
from onnxprune.calib.sources import load_calibration
from onnxprune.core import statistics
from onnxprune.pipeline import compress
from onnxprune.ir.batch import same_samples
from onnxprune.ir.load import import_graph
from onnxprune.ir.ort import light_export, model_input_specs
from onnxprune.ir.probe import fixed_batch
from onnxprune.strategies import Global, Ratio, Uniform, options_from
from tests.onnx_builders import GraphBuilder, compress_dead, kill, run, same_outputs, session


# ----------------------------------------------------------------------------- batch fixed in the graph


def _detector(batch: int | str, head_target: list[int]) -> onnx.ModelProto:
    """A stem whose 8 channels feed a head (conv → Reshape to ``head_target``, a graph output computed
    early and cached across later cuts) and a body (conv 16 → conv 4 → pool)."""
    b = GraphBuilder({"input": [batch, 3, 8, 8]})
    stem = b.op("Relu", [b.conv("input", "stem", 3, 8)], "stem_act")
    head = b.op("Reshape", [b.conv(stem, "head", 8, 6), b.const("t", np.array(head_target), np.int64)], "boxes")
    body = b.op("Relu", [b.conv(stem, "body", 8, 16)], "body_act")
    logits = b.op("Flatten", [b.op("GlobalAveragePool", [b.conv(body, "cls", 16, 4)], "gap")], "logits")
    return kill(b.model([head, logits]), {"stem": [1, 6], "body": [0, 5, 9, 14]})


def test_graph_that_fixes_its_batch_is_pruned_one_sample_at_a_time(tmp_path: Path) -> None:
    model = _detector("N", [1, 6, -1])
    fixed = fixed_batch(model)
    assert fixed is not None and fixed.size == 1
    assert "Reshape boxes gives boxes_out shape [1, 6, 128] at batch 2" in fixed.reason
    pruned, report = compress_dead(model, tmp_path, {"stem": 6, "body": 12}, (1, 3, 8, 8))
    assert report.fixed_batch == {"size": 1, "reason": fixed.reason}
    same_outputs(pruned, model, (1, 3, 8, 8))


@pytest.mark.parametrize("target", [[0, 6, -1], [1, 6, -1]])
def test_a_batch_the_input_fixes_is_calibrated_batched_and_written_back(tmp_path: Path, target: list[int],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A static batch 1 in the input (torch.onnx.export without dynamic_axes), and maybe in a Reshape's target:
    calibration runs batches through a copy with a free batch (the Reshape's 1 made 0, "copy the batch"), and
    the written model keeps the input and outputs of batch 1."""
    import onnxprune.ir.cache as cache

    batches = []
    real = cache.run_segment
    monkeypatch.setattr(cache, "run_segment", lambda *a, **k: (batches.append(k["batch_size"]), real(*a, **k))[1])
    model = _detector(1, target)
    assert fixed_batch(model).reason == "input 'input' has a static batch of 1"
    pruned, report = compress_dead(model, tmp_path, {"stem": 6, "body": 12}, (1, 3, 8, 8))
    assert report.fixed_batch is None and report.written_batch == {"size": 1, "reason": fixed_batch(model).reason}
    assert batches and set(batches) == {32}
    dims = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*pruned.graph.input, *pruned.graph.output]]
    assert dims == [[1, 3, 8, 8], [1, 6, 64], [1, 4]]
    same_outputs(pruned, model, (1, 3, 8, 8))


def _exported_static(batch: int | str) -> onnx.ModelProto:
    """As ultralytics' and torch's static exports write a head: the Reshape target is a ``Constant`` node read by
    two Reshapes (one before, one after the head's conv), and the stem weight passes through an ``Identity``
    (a tensor with no batch axis that no input computes)."""
    b = GraphBuilder({"input": [batch, 3, 8, 8]})
    b.nodes.append(onnx.helper.make_node("Constant", [], ["t"], name="t", value=numpy_helper.from_array(
        np.array([1, 6, -1], np.int64))))
    b.nodes.append(onnx.helper.make_node("Identity", [b.rand("cls.w0", (4, 16, 1, 1), 0.3)], ["cls.w"], name="id"))
    stem = b.op("Relu", [b.conv("input", "stem", 3, 8)], "stem_act")
    head = b.op("Reshape", [b.op("Reshape", [b.conv(stem, "head", 8, 6), "t"], "flat"), "t"], "boxes")
    body = b.op("Relu", [b.conv(stem, "body", 8, 16)], "body_act")
    logits = b.op("Flatten", [b.op("GlobalAveragePool", [b.op("Conv", [body, "cls.w"], "cls")], "gap")], "logits")
    return kill(b.model([head, logits]), {"stem": [1, 6], "body": [0, 5, 9, 14]})


def test_a_batch_fixed_by_constant_nodes_is_freed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The copy frees a batch written by a Constant-node target that two Reshapes share, and a weight's Identity
    (no batch axis, computed from no input) does not count as a tensor that mixes samples."""
    import onnxprune.ir.cache as cache

    batches = []
    real = cache.run_segment
    monkeypatch.setattr(cache, "run_segment", lambda *a, **k: (batches.append(k["batch_size"]), real(*a, **k))[1])
    assert fixed_batch(_exported_static("N")).reason.startswith("Reshape flat gives flat_out shape [1, 6, 128]")
    model = _exported_static(1)
    pruned, report = compress_dead(model, tmp_path, {"stem": 6, "body": 12}, (1, 3, 8, 8))
    assert report.fixed_batch is None and report.written_batch is not None
    assert batches and set(batches) == {32}
    same_outputs(pruned, model, (1, 3, 8, 8))


def test_a_batch_one_copy_is_checked_in_one_run_at_batch_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch 1 the verdict's run at batch 2 (does any tensor lose the samples?) is the copy's run at twice the
    batch: one onnxruntime run of the copy serves both, the fixed graph runs on each sample alone once, and a copy
    that mixes samples is still refused."""
    import onnxprune.ir.batch as batch

    runs = []
    real = batch.run_all_tensors
    monkeypatch.setattr(batch, "run_all_tensors", lambda *a, **k: (runs.append(a[1]), real(*a, **k))[1])
    assert batch.free_batch(_exported_static(1)) is not None
    assert len(runs) == 1 and {"boxes_out", "logits_out", "flat_out"} <= set(runs[0])
    runs.clear()
    assert batch.free_batch(_detector(1, [-1])) is None and len(runs) == 1  # [-1] folds the batch away


def test_a_free_batch_copy_is_judged_up_to_the_rounding_of_its_outputs_scale() -> None:
    """The copy's outputs at batch 2 match the fixed graph's on each sample alone up to a rounding that grows with
    the output (VGG-11's wide Gemm: 1.5e-5 near 0 where outputs reach 16, refused by a fixed 1e-5 before); samples
    mixed, or an output near 0 moved as much where outputs stay small, are not the same."""
    rng = np.random.default_rng(0)
    alone = rng.standard_normal((2, 1000)).astype(np.float32) * 5
    alone[0, 0], alone[0, 1] = 16.0, 1e-7
    rounded = alone.copy()
    rounded[0, 1] += 1.5e-5
    assert same_samples(rounded, alone) and not np.allclose(rounded, alone, rtol=1e-4, atol=1e-5)
    assert not same_samples(alone[::-1], alone)  # samples swapped
    small = alone / 40
    moved = small.copy()
    moved[0, 1] += 1.5e-5
    assert not same_samples(moved, small)


def test_batch_free_graph_keeps_batching() -> None:
    model = _detector("N", [0, 6, -1])
    assert fixed_batch(model) is None
    x = np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)
    assert run(model, input=x)[0].shape == (3, 6, 64)


def test_global_imitation_runs_on_a_fixed_batch_graph(tmp_path: Path) -> None:
    """Its candidates run one after another at the graph's batch (padded): on a graph that fixes its batch it
    prunes as on the same network exported with a free batch."""
    fixed, free = _detector("N", [1, 6, -1]), _detector("N", [0, 6, -1])
    pruned = {}
    for name, model in (("fixed", fixed), ("free", free)):
        pruned[name], report = compress_dead(model, tmp_path, {"stem": 6, "body": 12}, (1, 3, 8, 8), select=Global())
        assert all(layer.selection["method"] == "global" for layer in report.layers)
        assert (report.fixed_batch is None) == (name == "free")
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    for a, b in zip(run(pruned["fixed"], input=x), run(pruned["free"], input=x)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- shapes the exporter computes


def _computed_flatten(classes: int = 5) -> onnx.ModelProto:
    """``Reshape(y, [Where(Shape(y) > 0, Shape(y), 1)[0], -1])``: ONNX shape inference cannot evaluate
    ``Where`` on shapes, so the Gemm's input shape (and its MACs) are unknown until the model runs."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]})
    y = b.conv(b.op("Relu", [b.conv("input", "conv1", 3, 8)], "relu"), "conv2", 8, 6)
    shape = b.op("Shape", [y], "shape")
    same = b.op("Where", [b.op("Greater", [shape, b.const("z", np.zeros(4), np.int64)], "pos"), shape,
                          b.const("o", np.ones(4), np.int64)], "same")
    n = b.op("Slice", [same, b.const("s0", np.array([0]), np.int64), b.const("s1", np.array([1]), np.int64)], "n")
    target = b.op("Concat", [n, b.const("m1", np.array([-1]), np.int64)], "target", axis=0)
    out = b.gemm(b.op("Reshape", [y, target], "flat"), "fc", 6 * 64, classes)
    return kill(b.model([out]), {"conv1": [2, 3, 7]})


def test_shapes_the_exporter_computes_are_taken_from_a_run(tmp_path: Path) -> None:
    model = _computed_flatten()
    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    flat = next(v for v in inferred.graph.value_info if v.name == "flat_out")
    assert not flat.type.tensor_type.shape.dim[1].HasField("dim_value")  # what stopped the analysis before
    analysis = analyze(model)
    assert analysis.macs.total == 64 * (8 * 27 + 6 * 72) + 384 * 5
    assert [g.name for g in analysis.prunable] == ["conv1"]
    pruned, _ = compress_dead(model, tmp_path, {"conv1": 5}, (1, 3, 8, 8))
    assert fixed_batch(model) is None
    same_outputs(pruned, model, (3, 3, 8, 8))  # the batch stays dynamic


def test_the_import_reads_large_weights_in_place_and_hands_them_to_the_runs_that_fill_shapes() -> None:
    """An import sets weights of ``EXPORT_BYTES`` or more aside (shape inference reads stubs; an export, an inference
    and an import each copied them): the graph's constant reads the model's own tensor, and the run that fills
    the shapes inference leaves unknown is given the weights."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]})
    flat = b.op("Flatten", [b.op("Relu", [b.conv("input", "conv", 3, 6)], "relu")], "flat")
    plain = b.model([b.gemm(flat, "fc", 6 * 64, 1000)])  # fc.w: 384 × 1000 floats, 1.5 MB
    graph = import_graph(plain)
    fc = graph.tensors()["fc.w"]
    assert isinstance(fc._values, LazyValues)  # not loaded: no run needed it
    assert fc._values.tensor is next(t for t in plain.graph.initializer if t.name == "fc.w")
    assert [n.name for n in fc.outputs] == ["fc"]  # read by the imported graph's node alone
    model = _computed_flatten(classes=1000)
    graph = import_graph(model)
    assert graph.tensors()["flat_out"].shape[1] == 384  # from the run
    np.testing.assert_array_equal(graph.tensors()["fc.w"].values, numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == "fc.w")))


def test_the_batch_check_runs_a_light_export_with_its_weights_as_arrays() -> None:
    """``compress`` checks whether its graph batches on a light export (``ir.ort.light_export``), its weights handed
    over as arrays: exporting the whole graph copied VGG-11's 530 MB twice before onnxruntime's own copy."""
    model = _computed_flatten(classes=1000)  # fc.w: 384 × 1000 floats, 1.5 MB
    light, weights = light_export(import_graph(model))
    assert "fc.w" in weights and next(t for t in light.graph.initializer if t.name == "fc.w").ByteSize() < 1000
    feed = {"input": np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)}
    assert fixed_batch(model, feed) is None
    assert fixed_batch(light, feed, weights) is None  # batches freely, as the whole model does
    assert fixed_batch(light, feed).reason == "onnxruntime cannot run the graph at batch 2"  # the stub alone


def _tf2onnx_same_pads(hw: int | str) -> onnx.ModelProto:
    """tf2onnx's SAME padding when the size is not fixed at export: an NHWC input transposed to NCHW, and the
    pads of the second conv computed in the graph, ``max((ceil(H/2) - 1) * 2 + 3 - H, 0)`` split before/after,
    from ``Shape`` of the activation (``Shape → Slice → Div → Mul → Sub → Max → Concat → Pad``)."""
    b = GraphBuilder({"input": ["N", hw, hw, 3]})
    x = b.op("Transpose", ["input"], "to_nchw", perm=[0, 3, 1, 2])
    y = b.op("Relu", [b.conv(x, "conv1", 3, 8)], "relu")
    hw_ = b.op("Slice", [b.op("Shape", [y], "shape"), b.const("s2", [2], np.int64), b.const("s4", [4], np.int64)],
               "hw")
    two, one = b.const("two", [2, 2], np.int64), b.const("one", [1, 1], np.int64)
    out_hw = b.op("Div", [b.op("Add", [hw_, one], "hw1"), two], "out_hw")  # ceil(H / 2)
    need = b.op("Sub", [b.op("Add", [b.op("Mul", [b.op("Sub", [out_hw, one], "o1"), two], "o2"),
                                      b.const("k", [3, 3], np.int64)], "span"), hw_], "need")
    total = b.op("Max", [need, b.const("zero", [0, 0], np.int64)], "total")
    before = b.op("Div", [total, two], "before")
    after = b.op("Sub", [total, before], "after")
    zeros = b.const("z2", [0, 0], np.int64)
    pads = b.op("Concat", [zeros, before, zeros, after], "pads", axis=0)
    padded = b.op("Pad", [y, pads], "pad")
    z = b.conv(padded, "conv2", 8, 6, stride=2, pad=0)
    return kill(b.model([b.op("Transpose", [z], "to_nhwc", perm=[0, 2, 3, 1])]), {"conv1": [1, 4, 6]})


def test_pads_the_exporter_computes_are_folded_at_the_input_shape(tmp_path: Path) -> None:
    model = _tf2onnx_same_pads("H")
    specialised = specialise_inputs(model, {"input": [1, 9, 9, 3]}, "the test")
    inferred = onnx.shape_inference.infer_shapes(specialised, data_prop=True)
    conv2 = next(v for v in inferred.graph.value_info if v.name == "conv2_out")
    assert not conv2.type.tensor_type.shape.dim[2].HasField("dim_value")  # where the analysis stopped before
    analysis = analyze(specialised)
    assert [g.name for g in analysis.prunable] == ["conv1"], [(g.name, g.reason) for g in analysis.groups]
    assert analysis.macs.total == 81 * 8 * 27 + 25 * 6 * 72  # pads (1, 1): 9x9 -> 5x5 at stride 2
    pruned, _ = compress_dead(specialised, tmp_path, {"conv1": 5}, (1, 9, 9, 3))
    same_outputs(pruned, specialised, (3, 9, 9, 3))


# ----------------------------------------------------------------------------- narrow groups vs --round-to


@pytest.mark.parametrize("channels, round_to, step", [
    (8, 8, 2), (16, 8, 4), (24, 8, 4), (31, 8, 4), (32, 8, 8), (960, 8, 8), (2, 8, 1), (3, 8, 1), (12, 4, 2),
    (64, 1, 1), (10, 16, 2),
])
def test_group_step_lets_every_group_lose_a_quarter(channels: int, round_to: int, step: int) -> None:
    assert group_step(channels, round_to) == step
    assert step <= round_to and (channels < 4 or step <= channels // 4)


def _narrow_net() -> onnx.ModelProto:
    """Two 8-channel groups and a 12-channel one, as in a small direction classifier: with a step of 8
    for every group none of them could be narrowed at all."""
    b = GraphBuilder({"input": ["N", 3, 16, 16]})
    h = b.op("Relu", [b.conv("input", "a8", 3, 8, stride=2)], "ra")
    h = b.op("Relu", [b.conv(h, "b8", 8, 8)], "rb")
    h = b.op("Relu", [b.conv(h, "c12", 8, 12)], "rc")
    return b.model([b.conv(h, "head", 12, 16)])


def test_narrow_groups_are_pruned_in_finer_steps(tmp_path: Path) -> None:
    model = _narrow_net()
    analysis = analyze(model)
    assert all(group_step(g.channels, 8) < 8 for g in analysis.prunable)
    np.save(tmp_path / "c.npy", np.random.default_rng(0).standard_normal((16, 3, 16, 16)).astype(np.float32))
    calib = load_calibration(str(tmp_path / "c.npy"), model_input_specs(model))
    _, report = compress(model, calib, options_from(Ratio(0.85), provider="cpu"))
    assert report.macs_after <= 0.85 * report.macs_before
    assert report.layers and all(layer.step == {"a8": 2, "b8": 2, "c12": 2}[layer.group] for layer in report.layers)
    assert all(layer.kept % layer.step == 0 and layer.kept < layer.channels for layer in report.layers)


# ----------------------------------------------------------------------------- squeeze-excite gates


def _se_block() -> onnx.ModelProto:
    """expand 16 → depthwise → SE (pool → reduce 4 → excite 16 → sigmoid) × → project 8 (the output)."""
    b = GraphBuilder({"input": ["N", 8, 8, 8]})
    x = b.op("Relu", [b.conv("input", "expand", 8, 16, k=1)], "expand_act")
    x = b.op("Relu", [b.conv(x, "dw", 16, 16, group=16, bias=False)], "dw_act")
    s = b.op("Relu", [b.conv(b.op("GlobalAveragePool", [x], "se_pool"), "se_reduce", 16, 4, k=1)], "se_act")
    gate = b.op("Sigmoid", [b.conv(s, "se_excite", 4, 16, k=1)], "gate")
    return b.model([b.conv(b.op("Mul", [x, gate], "excited"), "project", 16, 8, k=1)])


def test_squeeze_excite_group_is_pruned_with_its_gate(tmp_path: Path) -> None:
    model = kill(_se_block(), {"expand": [0, 3, 4, 10, 15]})
    group = next(g for g in analyze(model).prunable if g.name == "expand")
    assert sorted(group.producers) == ["expand", "se_excite"]
    pruned, report = compress_dead(model, tmp_path, {"expand": 11}, (1, 8, 8, 8))
    assert [s["reason"] for s in report.skipped if s["group"] == "se_reduce"] == [
        "reduces the pooled channels of the gated group expand, pruned before it: not pruned"]
    inits = {t.name: numpy_helper.to_array(t) for t in pruned.graph.initializer}
    weight = {n.name: inits[n.input[1]] for n in pruned.graph.node if n.op_type == "Conv"}
    assert weight["se_excite"].shape[0] == weight["se_reduce"].shape[1] == weight["project"].shape[1] == 11
    same_outputs(pruned, model, (2, 8, 8, 8))


def test_squeeze_excite_refit_sees_the_gate_as_pruned(tmp_path: Path) -> None:
    """Live channels removed: the project conv is refitted on the gate that its refitted reducer gives, so
    the reported error of the group's consumers is what onnxruntime measures at their outputs."""
    model = _se_block()
    np.save(tmp_path / "c.npy", np.random.default_rng(3).standard_normal((24, 8, 8, 8)).astype(np.float32))
    calib = load_calibration(str(tmp_path / "c.npy"), model_input_specs(model))
    pruned, report = compress(model, calib, options_from(Ratio(0.7), allocate=Uniform(), round_to=1, min_channels=4,
                                                         provider="cpu"))
    assert [x.group for x in report.layers] == ["expand"]  # se_reduce (4 channels) stays whole
    names = ["se_reduce_out", "project_out"]
    outs = []
    for m in (pruned, model):
        m = onnx.ModelProto.FromString(m.SerializeToString())
        m.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
        outs.append(session(m).run(names, {"input": np.load(tmp_path / "c.npy")}))
    err = sum(float(((p - o) ** 2).sum()) for p, o in zip(*outs))
    energy = sum(float(((o - o.mean(axis=(0, 2, 3), keepdims=True)) ** 2).sum()) for o in outs[1])
    assert report.layers[0].error == pytest.approx(err / energy, rel=1e-3)
    assert report.layers[0].error < report.layers[0].error_fold


def test_paddle_batch_of_minus_one_stays_dynamic() -> None:
    b = GraphBuilder({"input": [-1, 3, "?", "?"]})
    model = b.model([b.conv("input", "c", 3, 4)])
    fixed = specialise_inputs(model, ["1x3x8x8"], "m")
    dims = fixed.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N" and [d.dim_value for d in dims[1:]] == [3, 8, 8]
    assert fixed_batch(fixed) is None


def test_one_channel_input_gets_grayscale_images(tmp_path: Path) -> None:
    """ddddocr's recogniser reads 1×64×W: images are converted to luminance, not refused."""
    from PIL import Image

    from onnxprune.calib.images import Preprocess
    from onnxprune.calib.sources import load_image_folder

    (tmp_path / "img").mkdir()
    Image.fromarray(np.full((8, 16, 3), [200, 100, 50], np.uint8)).save(tmp_path / "img" / "0_a.png")
    data = load_image_folder(tmp_path / "img", [("x", ["N", 1, 4, 8], np.dtype(np.float32))],
                             preprocess=Preprocess(resize=None, crop=None, mean=(0.5,) * 3, std=(0.25,) * 3))
    (x,) = next(data.batches(4)).values()
    luminance = (200 * 299 + 100 * 587 + 50 * 114) / 1000 / 255  # PIL's ITU-R 601 conversion
    assert x.shape == (1, 1, 4, 8)
    np.testing.assert_allclose(x, (luminance - 0.5) / 0.25, atol=0.02)


def test_recover_trains_a_static_batch_export_through_a_free_batch_copy(tmp_path: Path) -> None:
    """A batch the input alone fixes (torch.onnx.export without dynamic_axes) trains as compress calibrates it,
    through a copy with a free batch, and the written model keeps batch 1; a graph that writes its batch inside is
    refused in one line, naming where."""
    from onnxprune.errors import OnnxPruneError
    from onnxprune.recovery import RecoverOptions, recover

    np.save(tmp_path / "c.npy", np.random.default_rng(0).standard_normal((12, 3, 8, 8)).astype(np.float32))
    teacher = _detector(1, [1, 6, -1])
    calib = load_calibration(str(tmp_path / "c.npy"), model_input_specs(teacher))
    student = kill(_detector(1, [1, 6, -1]), {"stem": [0, 3]})
    model, report = recover(student, teacher, calib, RecoverOptions(steps=5, distill_steps=5, provider="cpu"))
    assert report.improved
    dims = [[d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*model.graph.input, *model.graph.output]]
    assert dims == [[1, 3, 8, 8], [1, 6, 64], [1, 4]]
    run(model, input=np.zeros((1, 3, 8, 8), np.float32))
    inside = _detector("N", [1, 6, -1])
    with pytest.raises(OnnxPruneError, match=r"recover trains on batches .* the pruned model fixes its batch \(inside "
                                             r"the graph: Reshape boxes gives boxes_out shape \[1, 6, 128\] at batch 2"):
        recover(kill(_detector("N", [1, 6, -1]), {"stem": [0]}), inside, calib, RecoverOptions(steps=1, provider="cpu"))


def test_thinned_statistics_stay_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the Gram budgets the statistics take every k-th position, counted across samples: inputs and
    targets must be thinned alike (a mismatch would leave the dead-channel model inexact or crash)."""
    monkeypatch.setattr(statistics, "STATS_GRAM_MACS", 1_000_000)
    monkeypatch.setattr(statistics, "CURVE_GRAM_MACS", 500_000)
    assert statistics._stride(8 * 9, 12 * 64, 1_000_000) == 4  # the stem group's 3x3 consumers: 1 position in 4
    a = torch.arange(2 * 3 * 5).reshape(2, 3, 5)
    # per channel the positions are sample 0's five, then sample 1's: from 1 on, every 4th is 1, 5 and 9
    assert consumers.thin(a, 4, 1).tolist() == [[[1, 15, 19], [6, 20, 24], [11, 25, 29]]]
    assert consumers.thin(a, 1, 0) is a
    model = _detector("N", [0, 6, -1])
    pruned, _ = compress_dead(model, tmp_path, {"stem": 6, "body": 12}, (1, 3, 8, 8))
    same_outputs(pruned, model, (2, 3, 8, 8))


def test_a_probe_that_fails_prints_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """The batch probes run graphs that may not run at batch 2 (a Reshape that writes batch 1): the failure is
    their answer, and onnxruntime's error line must not reach the user's terminal."""
    from onnxprune.ir.probe import run_all_tensors

    b = GraphBuilder({"x": ["N", 3, 4]})
    flat = b.op("Reshape", [b.op("Relu", ["x"], "r0"), b.const("to", np.array([1, 12], np.int64), np.int64)], "flat")
    out = b.op("Relu", [flat], "r1")
    model = b.model([out])
    assert run_all_tensors(model, [out], {"x": np.zeros((2, 3, 4), np.float32)}) is None
    assert fixed_batch(model) is not None
    assert "onnxruntime" not in capfd.readouterr().err


def test_values_read_from_a_shape_do_not_fix_the_batch() -> None:
    """A float scalar computed from the input's dims (YOLOv8's anchor grid: Shape → Gather → Cast → Range) is the
    same for every sample and holds none: the batch stays free."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]})
    feat = b.conv("input", "stem", 3, 4)
    size = b.op("Cast", [b.op("Gather", [b.op("Shape", [feat], "dims"), b.const("h", np.array(2), np.int64)],
                                        "height")], "height_f", to=onnx.TensorProto.FLOAT)
    out = b.op("Mul", [feat, size], "scaled")
    model = b.model([out])
    assert fixed_batch(model) is None
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    assert run(model, input=x)[0].shape == (2, 4, 8, 8)
