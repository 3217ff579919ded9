"""``quantize``: the written QDQ model runs in onnxruntime, its weights dequantize to within one step of the float
ones, the layers it reports in float are the ones without quantized weights, the TensorRT layout is explicit and
symmetric, and a bad input is refused in one line with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import numpy_helper
from typer.testing import CliRunner

from onnxprune import api
from onnxprune.analysis.macs import count_params
from onnxprune.cli import app
from onnxprune.deploy.quantize import (
    WEIGHTED,
    QuantizeOptions,
    end_widths,
    ends,
    prefix,
    saturating_cpu,
    split,
    suffix,
    tail,
)
from onnxprune.deploy.rounding import gptq_round, input_grams
from onnxprune.deploy.evaluation import evaluate
from tests.onnx_builders import run

FAST = QuantizeOptions(methods=("minmax",), float_ends="no", rounding="nearest", samples=32)


def _initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _dequantized_weights(model: onnx.ModelProto) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{weighted node: (its dequantized weight, the step of each value)} for the nodes whose weight is a DQ of a
    constant."""
    values = _initializers(model)
    producer = {o: n for n in model.graph.node for o in n.output}
    out = {}
    for node in model.graph.node:
        dq = producer.get(node.input[1]) if node.op_type in WEIGHTED else None
        if dq is None or dq.op_type != "DequantizeLinear" or dq.input[0] not in values:
            continue
        q, scale = values[dq.input[0]].astype(np.float64), values[dq.input[1]].astype(np.float64)
        zero = values[dq.input[2]].astype(np.float64) if len(dq.input) > 2 and dq.input[2] else np.zeros_like(scale)
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
        shape = [1] * q.ndim
        if scale.size > 1:
            shape[axis] = -1
        step = np.broadcast_to(scale.reshape(shape), q.shape)
        out[node.name] = ((q - zero.reshape(shape)) * scale.reshape(shape), step)
    return out


def test_the_int8_model_runs_and_its_weights_dequantize_to_within_one_step(tiny) -> None:
    result = api.quantize(tiny.path, tiny.calib, options=FAST)
    report = result.report
    y = run(result.model, **{result.model.graph.input[0].name: tiny.x[:4]})[0]
    assert y.shape == run(tiny.model, **{tiny.model.graph.input[0].name: tiny.x[:4]})[0].shape
    floats = _initializers(tiny.model)
    original = {n.name: floats[n.input[1]] for n in tiny.model.graph.node if n.op_type in WEIGHTED}
    weights = _dequantized_weights(result.model)
    assert weights and set(weights) | set(report.unquantized) == set(original)
    for name, (w, step) in weights.items():
        assert np.all(np.abs(w - original[name]) <= step + 1e-7), name
    assert report.method == "minmax" and report.calibration_samples == 32 and report.held_samples == 13
    assert report.candidates[0].metric == report.metric == "agreement"  # the tiny model's output reads as logits


def test_the_layers_reported_in_float_are_the_ends_and_have_float_weights(tiny) -> None:
    result = api.quantize(tiny.path, tiny.calib, options=QuantizeOptions(methods=("minmax",), float_ends="yes",
                                                                          samples=16))
    report = result.report
    kept = ends(api.load(tiny.path))
    named = {n.name for n in result.model.graph.node if n.op_type in WEIGHTED}
    assert len(kept) >= 2 and set(kept) <= named
    assert report.float_nodes == kept and report.unquantized == kept
    assert set(kept).isdisjoint(_dequantized_weights(result.model))
    constants = _initializers(result.model)
    assert all(next(n for n in result.model.graph.node if n.name == k).input[1] in constants for k in kept)


def test_auto_keeps_the_best_candidate_of_every_method_and_the_ends(tiny) -> None:
    options = QuantizeOptions(methods=("minmax", "percentile"), float_ends="auto", samples=16)
    report = api.quantize(tiny.path, tiny.calib, options=options).report
    tried = [(c.method, bool(c.float_nodes)) for c in report.candidates]
    best = max(report.candidates, key=lambda c: c.key())
    assert tried[:2] == [("minmax", False), ("percentile", False)] and tried[2][1]
    assert (report.method, report.float_nodes) == (best.method, best.float_nodes)


def test_the_tensorrt_layout_quantizes_every_weighted_input_symmetrically(tiny) -> None:
    options = QuantizeOptions(runtime="tensorrt", methods=("minmax",), float_ends="no", samples=16)
    result = api.quantize(tiny.path, tiny.calib, options=options)
    model, values = result.model, _initializers(result.model)
    producer = {o: n for n in model.graph.node for o in n.output}
    weighted = [n for n in model.graph.node if n.op_type in WEIGHTED]
    assert weighted and result.report.simulated and not result.report.reduce_range
    for node in weighted:
        assert [producer[i].op_type for i in node.input[:2]] == ["DequantizeLinear"] * 2, node.name
        assert len(node.input) < 3 or node.input[2] in values  # float bias: TensorRT dequantizes int8 only
    for dq in (n for n in model.graph.node if n.op_type == "DequantizeLinear"):
        assert values[dq.input[2]].dtype == np.int8 and not values[dq.input[2]].any(), dq.name
    users: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            users.setdefault(i, []).append(n)
    for q in (n for n in model.graph.node if n.op_type == "QuantizeLinear"):  # before weighted inputs only
        assert any(u.op_type in WEIGHTED for dq in users[q.output[0]] for u in users[dq.output[0]]), q.name


def test_the_onnxruntime_layout_narrows_weights_only_where_the_cpu_saturates(tiny) -> None:
    report = api.quantize(tiny.path, tiny.calib, options=FAST).report
    assert report.reduce_range == saturating_cpu()
    assert any("7 bits" in note for note in report.notes) == saturating_cpu()
    forced = api.quantize(tiny.path, tiny.calib, options=QuantizeOptions(
        methods=("minmax",), float_ends="no", samples=8, reduce_range=True)).report
    assert forced.reduce_range and not any("7 bits" in note for note in forced.notes)


def test_a_reference_is_what_both_models_are_judged_against(tiny) -> None:
    report = api.quantize(tiny.path, tiny.calib, reference=tiny.path, options=FAST).report
    assert report.reference == str(tiny.path)
    assert report.fp32["value"] == 1.0 and report.fp32["kl"] == pytest.approx(0.0, abs=1e-6)  # itself
    assert report.int8["kl"] > 1e-6


def test_evaluate_reads_a_calibration_set_and_the_labels_of_its_images(tiny, tmp_path: Path) -> None:
    from PIL import Image

    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(folder / f"{i:03d}_x.png")
    prep = api.preprocess_for(tiny.path)
    data = api.calibration(folder, api.load(tiny.path), prep)
    from_set, from_folder = evaluate(tiny.path, data, ref=tiny.path), evaluate(tiny.path, folder, ref=tiny.path,
                                                                                preprocess=prep)
    assert from_set.images == from_folder.images == 6
    assert from_set.cosine == pytest.approx(from_folder.cosine)


def test_the_quantize_command_writes_the_model_and_its_report(tiny, tmp_path: Path) -> None:
    out, report = tmp_path / "q.onnx", tmp_path / "q.json"
    result = CliRunner().invoke(app, ["quantize", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib),
                                      "--methods", "minmax", "--float-ends", "no", "--samples", "16", "--report",
                                      str(report), "-q"])
    assert result.exit_code == 0, result.output
    data = json.loads(report.read_text())
    assert data["method"] == "minmax" and data["runtime"] == "onnxruntime" and "int8" in data
    assert "INT8 candidates" in result.output and f"wrote {out}" in result.output.replace("\n", "")
    assert any(n.op_type == "DequantizeLinear" for n in onnx.load(str(out)).graph.node)


def test_an_already_quantized_model_is_refused_in_one_line(tiny, tmp_path: Path) -> None:
    quantized = tmp_path / "q.onnx"
    onnx.save(api.quantize(tiny.path, tiny.calib, options=FAST).model, str(quantized))
    out = tmp_path / "again.onnx"
    result = CliRunner().invoke(app, ["quantize", str(quantized), "-o", str(out), "--calib", str(tiny.calib), "-q"])
    assert result.exit_code == 2 and "quantized already" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_an_empty_calibration_folder_is_refused_in_one_line(tiny, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = tmp_path / "q.onnx"
    result = CliRunner().invoke(app, ["quantize", str(tiny.path), "-o", str(out), "--calib", str(tmp_path / "empty"),
                                      "-q"])
    assert result.exit_code == 2 and "no images" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()


def test_a_bad_option_is_refused_before_any_work(tiny, tmp_path: Path) -> None:
    out = tmp_path / "q.onnx"
    result = CliRunner().invoke(app, ["quantize", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib),
                                      "--methods", "minmax,kl", "-q"])
    assert result.exit_code == 2 and "kl" in result.output and "--methods" in result.output and not out.exists()


def test_compress_int8_writes_the_int8_model_beside_the_pruned_one(tiny, tmp_path: Path) -> None:
    out, report = tmp_path / "small.onnx", tmp_path / "small.json"
    result = CliRunner().invoke(app, ["compress", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib),
                                      "--target-ratio", "0.7", "--int8", "--report", str(report), "-q"])
    assert result.exit_code == 0, result.output
    quantized = tmp_path / "small.int8.onnx"
    assert any(n.op_type == "DequantizeLinear" for n in onnx.load(str(quantized)).graph.node)
    assert not any(n.op_type == "DequantizeLinear" for n in onnx.load(str(out)).graph.node)
    data = json.loads(report.read_text())
    assert data["macs_after"] < data["macs_before"] and data["int8"]["path"] == str(quantized)
    assert data["int8"]["reference"] == str(tiny.path) and data["int8"]["fp32"]["value"] < 1.0  # the pruned model


def test_compress_int8_passes_max_loss_to_its_quantization(tiny, tmp_path: Path) -> None:
    from onnxprune.flags.jobs import int8

    out = tmp_path / "small.onnx"
    args = ["compress", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib), "--target-ratio", "0.7", "-q"]
    refused = CliRunner().invoke(app, [*args, "--max-loss", "0.01"])
    assert refused.exit_code == 2 and "give it with --int8" in refused.output and not out.exists()
    values = {"int8": True, "runtime": "onnxruntime", "task": "auto", "max_loss": 0.02}
    assert int8(values).max_loss == 0.02 and int8({**values, "max_loss": None}).max_loss is None


def test_an_int8_model_counts_the_parameters_of_its_float_model(tiny) -> None:
    quantized = api.quantize(tiny.path, tiny.calib, options=FAST).model
    assert count_params(gs.import_onnx(quantized)) == count_params(gs.import_onnx(tiny.model))


def _boxes_and_scores(path: Path) -> Path:
    """A detector-like head: a Conv whose first two channels are boxes in pixels (×100) and the other two class
    scores through a sigmoid, concatenated into one output."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    consts = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
              (("s0", [0]), ("s2", [2]), ("s4", [4]), ("ax", [1]))] + [numpy_helper.from_array(np.float32(100), "k")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Slice", ["y", "s0", "s2", "ax"], ["b"], name="boxes"),
             helper.make_node("Mul", ["b", "k"], ["pixels"], name="scale"),
             helper.make_node("Slice", ["y", "s2", "s4", "ax"], ["c"], name="classes"),
             helper.make_node("Sigmoid", ["c"], ["scores"], name="sigmoid"),
             helper.make_node("Concat", ["pixels", "scores"], ["out"], name="concat", axis=1)]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 4, 8, 8])], [w, *consts])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_head_s_decoding_stays_in_float(tmp_path: Path) -> None:
    path = _boxes_and_scores(tmp_path / "head.onnx")
    assert tail(onnx.load(str(path))) == ["boxes", "scale", "classes", "sigmoid", "concat"]
    x = np.random.default_rng(1).standard_normal((40, 3, 8, 8)).astype(np.float32)
    result = api.quantize(path, x, options=QuantizeOptions(methods=("minmax",), float_ends="no"))
    assert result.report.tail == ["boxes", "scale", "classes", "sigmoid", "concat"]
    ours, theirs = run(result.model, x=x[:8])[0], run(str(path), x=x[:8])[0]
    assert np.abs(ours[:, 2:] - theirs[:, 2:]).max() < 0.1  # the scores, beside boxes 100× larger


def test_the_held_split_keeps_an_image_and_its_mirror_together(tmp_path) -> None:
    """``split`` holds out every fifth image with its mirror (adjacent with --flip): no held sample's mirror
    calibrates."""
    from PIL import Image

    from onnxprune.calib.images import Preprocess
    from onnxprune.calib.sources import load_image_folder

    for i in range(10):
        Image.new("RGB", (8, 8), (20 * i, 0, 0)).save(tmp_path / f"{i:03d}_x.png")
    specs = [("x", ["N", 3, 8, 8], np.dtype(np.float32))]
    data = load_image_folder(tmp_path, specs, preprocess=Preprocess(crop=None), flip=True)
    rest, held = split(data, every=5)
    assert (len(rest), len(held)) == (16, 4)
    red = lambda s: sorted(np.concatenate([b["x"][:, 0, 0, 0] for b in s.batches(4)]).round(4).tolist())  # noqa: E731
    assert not set(red(held)) & set(red(rest)) and len(set(red(held))) == 2


# ----------------------------------------------------------------------------- GPTQ rounding


def _output_error(weight: np.ndarray, rounded: np.ndarray, gram: np.ndarray) -> float:
    """‖(W − Ŵ) x‖² summed over the inputs whose Gram matrix is ``gram``: tr(Δ G Δᵀ)."""
    delta = weight - rounded
    return float(np.einsum("od,de,oe->", delta, gram, delta))


def _grouped_error(weight: np.ndarray, rounded: np.ndarray, grams: np.ndarray) -> float:
    """``_output_error`` of a conv's weight, summed over its groups (``grams``: one Gram matrix each)."""
    shape = (len(grams), len(weight) // len(grams), -1)
    return sum(_output_error(w, r, g) for w, r, g in zip(weight.reshape(shape), rounded.reshape(shape), grams))


def test_gptq_rounds_to_the_nearest_where_the_inputs_are_uncorrelated() -> None:
    rng = np.random.default_rng(0)
    w, scale = rng.standard_normal((6, 10)), np.full(6, 0.05)
    q = gptq_round(w, np.diag(rng.uniform(1, 2, 10)), scale, 127)
    np.testing.assert_array_equal(q, np.clip(np.round(w / scale[:, None]), -127, 127))


def test_gptq_moves_the_layer_output_less_than_rounding_to_the_nearest() -> None:
    """Correlated inputs (a pruned layer's kept channels): the errors of the columns rounded first are carried by
    the later ones, the output error falls well below the nearest rounding's, the integers stay within ±qmax."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, 4)) @ rng.standard_normal((4, 2000)) + 0.1 * rng.standard_normal((12, 2000))
    gram, w = x @ x.T, rng.standard_normal((8, 12))
    scale = np.abs(w).max(1) / 64
    nearest = np.clip(np.round(w / scale[:, None]), -64, 64)
    q = gptq_round(w, gram, scale, 64)
    assert np.abs(q).max() <= 64
    assert _output_error(w, q * scale[:, None], gram) < 0.5 * _output_error(w, nearest * scale[:, None], gram)


def test_quantize_with_gptq_keeps_the_scales_and_lowers_every_layers_output_error(tiny) -> None:
    """The GPTQ candidate differs from the nearest one in its integers only (scales, zero points, ranges alike), and
    no quantized layer's output error on the calibration samples is higher; on average it is lower."""
    options = {"methods": ("minmax",), "float_ends": "no", "samples": 32}
    nearest = api.quantize(tiny.path, tiny.calib, options=QuantizeOptions(rounding="nearest", **options))
    gptq = api.quantize(tiny.path, tiny.calib, options=QuantizeOptions(rounding="gptq", **options))
    assert gptq.report.rounding == "gptq" and [c.rounding for c in gptq.report.candidates] == ["gptq"]
    a, b = _dequantized_weights(nearest.model), _dequantized_weights(gptq.model)
    assert a.keys() == b.keys() and all(np.array_equal(a[k][1], b[k][1]) for k in a)
    nodes = [n for n in tiny.model.graph.node if n.name in a]
    grams = input_grams(tiny.model, nodes, [{tiny.model.graph.input[0].name: tiny.x[i:i + 8]} for i in (0, 8)])
    floats = _initializers(tiny.model)
    totals = np.zeros(2)
    for node in nodes:
        w, gram = floats[node.input[1]].astype(np.float64), grams[node.name]
        errors = np.array([_grouped_error(w, a[node.name][0], gram), _grouped_error(w, b[node.name][0], gram)])
        assert errors[1] <= errors[0] * 1.001, node.name
        totals += errors / errors[0]
    assert totals[1] < 0.9 * totals[0]  # on average a layer's error falls by more than a tenth


def test_float_ends_hold_the_first_and_last_weighted_layers_and_every_node_before_and_after(tiny) -> None:
    model = api.load(tiny.path)
    nodes = list(model.graph.node)
    weighted = [i for i, n in enumerate(nodes) if n.op_type in WEIGHTED]
    widths = end_widths(model)
    assert widths == [w for w in (2, 4, 8, 16, 32) if w <= len(weighted) // 4] and widths
    for width in widths:
        assert prefix(model, width) == [n.name for n in nodes[:weighted[width]]]
        assert sum(nodes[i].name in prefix(model, width) for i in weighted) == width
        assert suffix(model, width) == [n.name for n in nodes[weighted[-width]:]]
        assert sum(nodes[i].name in suffix(model, width) for i in weighted) == width
    assert suffix(model, 0) == []


def test_max_loss_widens_the_float_prefix_to_the_narrowest_within_it(tiny) -> None:
    raw = {"methods": ("minmax",), "float_ends": "no", "rounding": "nearest", "samples": 16, "task": "raw"}
    widest = api.quantize(tiny.path, tiny.calib, options=QuantizeOptions(**raw, max_loss=1e-9)).report
    tried = [(c.prefix, c.value) for c in widest.candidates]
    assert [p for p, _ in tried] == [0, *end_widths(api.load(tiny.path))]  # never within: every width tried
    assert widest.notes and "no candidate came within --max-loss" in widest.notes[0]
    (_, none), (two, at_two) = tried[:2]
    assert at_two > none  # two layers in float lose less
    loss = widest.fp32["value"] - (none + at_two) / 2
    report = api.quantize(tiny.path, tiny.calib, options=QuantizeOptions(**raw, max_loss=loss)).report
    assert [c.prefix for c in report.candidates] == [0, two] and report.prefix == two
    assert report.unquantized == report.float_nodes and len(report.unquantized) == 2 * two
    assert set(report.unquantized) <= set(prefix(api.load(tiny.path), two)) | set(suffix(api.load(tiny.path), two))
    within = api.quantize(tiny.path, tiny.calib, options=QuantizeOptions(**raw, max_loss=0.5)).report
    assert [c.prefix for c in within.candidates] == [0] and within.prefix == 0
    assert not any("--max-loss" in note for note in within.notes)
