"""Export classes of the third round, built in code as the real exports write them: control flow (a Loop whose
body reads a feature map, a decoded sequence whose length varies), time-major tensors (batch on axis 1), a
channels-last flatten into a MatMul (Keras), channel and spatial counts read at run time (Paddle's
``Shape → Cast → Slice``), recurrent layers; and the check that a written model runs.

The oracle is exactness, as in ``test_real_exports``: the channels a test removes are dead, so the pruned model
must reproduce the original's outputs in onnxruntime."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxprune import api
from onnxprune.ir import cache
from onnxprune.analysis import analyze
from onnxprune.errors import ModelError, UnsupportedOpError
from onnxprune.deploy.evaluation import evaluate
from onnxprune.normal.flatten_channels_first import flatten_channels_first
from onnxprune.normal.flatten_channels_first import channels_first_heads
from onnxprune.ir.graph import EXPORT_BYTES
from onnxprune.ir.load import inferred_graph
from onnxprune.ir.ort import zero_pad
from onnxprune.ir.probe import fixed_batch
from onnxprune.strategies import Ratio, Uniform
from onnxprune.tasks import raw_discrepancy, task_named
from tests.onnx_builders import GraphBuilder, compress_dead, kill, run, same_outputs


def _reason(model: onnx.ModelProto, name: str) -> str | None:
    return next(g.reason for g in analyze(model).groups if g.name == name)


# ----------------------------------------------------------------------------- control flow


def _loop_body(reads: str, channels: int, b: GraphBuilder) -> onnx.GraphProto:
    """A Loop body carrying ``acc`` [N, 4]: acc + mean over space of the outer tensor ``reads`` times a 4-column
    matrix (the MatMul the MAC count leaves out)."""
    w = helper.make_tensor("body.w", TensorProto.FLOAT, (channels, 4),
                           b.rng.standard_normal((channels, 4)).ravel().tolist())
    nodes = [
        helper.make_node("ReduceMean", [reads], ["body.mean"], name="body.mean", axes=[2, 3], keepdims=0),
        helper.make_node("MatMul", ["body.mean", "body.w"], ["body.proj"], name="body.proj"),
        helper.make_node("Add", ["acc", "body.proj"], ["acc_next"], name="body.add"),
        helper.make_node("Identity", ["cond"], ["cond_next"], name="body.cond"),
    ]
    return helper.make_graph(
        nodes, "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("cond_next", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_next", TensorProto.FLOAT, ["N", 4])],
        [w])


def _looped() -> onnx.ModelProto:
    """stem (8) → mid (16) → late (8) → head (4, an output); a Loop after them all reads mid's output inside its
    body (so mid's output stays cached past late's cut)."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]})
    stem = b.op("Relu", [b.conv("input", "stem", 3, 8)], "stem_act")
    mid = b.op("Relu", [b.conv(stem, "mid", 8, 16)], "mid_act")
    late = b.op("Relu", [b.conv(mid, "late", 16, 8)], "late_act")
    head = b.conv(late, "head", 8, 4)
    zeros = b.op("ReduceMean", [head], "zeros0", axes=[2, 3], keepdims=0)
    acc0 = b.op("Mul", [zeros, b.const("zero", 0.0)], "acc0")
    b.nodes.append(helper.make_node("Loop", [b.const("trips", np.array(3), np.int64), b.const("go", np.array(True), bool),
                                             acc0], ["loop_out"], name="loop", body=_loop_body(mid, 16, b)))
    model = b.model({head: ["N", 4, 8, 8], "loop_out": ["N", 4]})
    return kill(model, {"stem": [1, 6], "late": [0, 7]})


def _bodies(model: onnx.ModelProto) -> list[bytes]:
    return [a.g.SerializeToString() for n in model.graph.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]


def test_a_loop_reading_a_feature_map_keeps_it_and_the_cnn_before_it_is_pruned(tmp_path: Path) -> None:
    model = _looped()
    analysis = analyze(model)
    assert _reason(model, "mid") == "Loop loop reads the channels inside its subgraph, which is left as it is"
    assert next(g for g in analysis.groups if g.name == "stem").prunable
    assert analysis.uncounted == ["Loop loop (1 MatMul)"]
    assert analysis.to_dict()["macs_not_counted_in"] == ["Loop loop (1 MatMul)"]
    pruned, _ = compress_dead(model, tmp_path, {"stem": 6, "late": 6}, (1, 3, 8, 8))
    assert _bodies(pruned) == _bodies(model)  # byte for byte
    same_outputs(pruned, model, (2, 3, 8, 8))


def test_a_loop_input_blocks_its_channels_in_words() -> None:
    b = GraphBuilder({"input": ["N", 3, 8, 8]})
    feat = b.op("ReduceMean", [b.conv("input", "feat", 3, 4)], "pooled", axes=[2, 3], keepdims=0)
    b.nodes.append(helper.make_node("Loop", [b.const("trips", np.array(2), np.int64), b.const("go", np.array(True), bool),
                                             feat], ["loop_out"], name="loop", body=_loop_body("input", 3, b)))
    model = b.model({"loop_out": ["N", 4]})
    assert _reason(model, "feat") == "Loop loop is control flow: its subgraph is left as it is"


def _decoder(threshold: float) -> onnx.ModelProto:
    """A feature extractor, then a Loop that adds sigmoid(features) to its state until the state's largest entry
    passes ``threshold`` (at most 12 steps), as an attention decoder stops at its end token: the scan output
    ``steps_out`` [N, T, 4] is a decoded sequence whose length varies from input to input."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]}, seed=3)
    stem = b.op("Relu", [b.conv("input", "stem", 3, 8)], "stem_act")
    feat = b.op("ReduceMean", [b.conv(stem, "feat", 8, 4)], "feat_mean", axes=[2, 3], keepdims=0)
    limit = helper.make_tensor("body.limit", TensorProto.FLOAT, [], [threshold])
    body = helper.make_graph(
        [helper.make_node("Sigmoid", [feat], ["body.gate"], name="body.gate"),
         helper.make_node("Add", ["acc", "body.gate"], ["acc_next"], name="body.add"),
         helper.make_node("ReduceMax", ["acc_next"], ["body.max"], name="body.max", keepdims=0),
         helper.make_node("Less", ["body.max", "body.limit"], ["cond_next"], name="body.go_on"),
         helper.make_node("Identity", ["acc_next"], ["step"], name="body.step")],
        "body",
        [helper.make_tensor_value_info("iter", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("cond_next", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_next", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("step", TensorProto.FLOAT, ["N", 4])],
        [limit])
    acc0 = b.op("Mul", [feat, b.const("zero", 0.0)], "acc0")
    b.nodes.append(helper.make_node("Loop", [b.const("most", np.array(12), np.int64), b.const("go", np.array(True), bool),
                                             acc0], ["final", "scan"], name="decode", body=body))
    steps = b.op("Transpose", ["scan"], "steps", perm=[1, 0, 2])
    return b.model({"final": ["N", 4], steps: ["N", "T", 4]})


def test_outputs_of_varying_length_are_compared_zero_padded(tmp_path: Path) -> None:
    a, b = np.ones((1, 3, 4)), np.ones((1, 5, 4))
    pa, pb = zero_pad(a, b)
    assert pa.shape == pb.shape == (1, 5, 4) and pa[:, 3:].sum() == 0
    assert raw_discrepancy([{"y": a}], [{"y": b}]) == pytest.approx(8 / 12)  # the extra 8 entries against 0
    short, long = tmp_path / "short.onnx", tmp_path / "long.onnx"
    onnx.save(_decoder(2.0), short)
    onnx.save(_decoder(5.0), long)
    photos = tmp_path / "photos"
    photos.mkdir()
    from PIL import Image
    rng = np.random.default_rng(0)
    for i in range(4):
        Image.fromarray(rng.integers(0, 255, (10, 10, 3), dtype=np.uint8)).save(photos / f"{i}.png")
    result = evaluate(long, photos, ref=short, task="raw", preprocess=api.preprocess_for(long, crop=8, resize=8))
    assert result.padded == ["steps_out"] and result.rel_l2["steps_out"] > 0


def test_compress_runs_through_a_decoder_of_varying_length(tmp_path: Path) -> None:
    model = kill(_decoder(4.0), {"stem": [0, 3]})
    lengths = {run(model, input=np.random.default_rng(s).standard_normal((1, 3, 8, 8)).astype(np.float32))[1].shape[1]
               for s in range(20)}
    assert len(lengths) > 1  # the oracle below sees sequences of several lengths
    pruned, _ = compress_dead(model, tmp_path, {"stem": 6}, (1, 3, 8, 8))
    assert _bodies(pruned) == _bodies(model)
    same_outputs(pruned, model, (1, 3, 8, 8), runs=6)


def test_a_matmul_after_a_loop_is_not_counted_and_the_cnn_in_front_is_pruned(tmp_path: Path) -> None:
    """A CNN + recurrent reader exported with its recurrence as a Loop (tf2onnx's LSTMs): the MatMul after the Loop
    has shapes no static inference knows. Its MACs are left out, by name, and the CNN in front is pruned."""
    model = kill(_decoder(4.0), {"stem": [0, 3]})
    weight = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(weight, "proj.w"))
    model.graph.node.append(helper.make_node("MatMul", ["steps_out", "proj.w"], ["proj_out"], name="proj"))
    model.graph.output.append(helper.make_tensor_value_info("proj_out", TensorProto.FLOAT, ["N", "T", 3]))
    analysis = analyze(model)
    assert analysis.macs.unknown == ["MatMul proj: unknown shapes: static shapes end at Loop decode"]
    assert analysis.macs.total == analyze(_decoder(4.0)).macs.total > 0
    pruned, _ = compress_dead(model, tmp_path, {"stem": 6}, (1, 3, 8, 8))
    same_outputs(pruned, model, (1, 3, 8, 8), runs=4)


def test_recover_says_in_one_line_why_it_cannot_train_through_a_loop(tmp_path: Path) -> None:
    model = _looped()
    x = np.random.default_rng(0).standard_normal((12, 3, 8, 8)).astype(np.float32)
    result = api.compress(model, x, budget=Ratio(0.8), allocate=Uniform(), provider="cpu")
    with pytest.raises(UnsupportedOpError, match=r"cannot run 1 op type\(s\) of this model: Loop at node\(s\) 'loop': "
                                                 r"training \(recover\) needs the whole model in torch"):
        result.recover()


# ----------------------------------------------------------------------------- time-major tensors


def _time_major(merge_batch: bool = False) -> onnx.ModelProto:
    """stem (8) → feat (8) → Transpose to [W, N, C, H] → Reshape [W, N, C·H] → MatMul: a CRNN's time-major
    [T, N, classes] output; with ``merge_batch`` the Reshape folds T and N into one axis, as ddddocr's does."""
    b = GraphBuilder({"input": ["N", 3, 8, 16]})
    stem = b.op("Relu", [b.conv("input", "stem", 3, 8)], "stem_act")
    feat = b.op("Relu", [b.conv(stem, "feat", 8, 8)], "feat_act")
    seq = b.op("Transpose", [feat], "to_time", perm=[3, 0, 1, 2])
    target = [-1, 64] if merge_batch else [16, 0, 64]
    flat = b.op("Reshape", [seq, b.const("target", np.array(target), np.int64)], "flatten")
    out = b.matmul(flat, "cls", 64, 10)
    return kill(b.model({out: [None, 10] if merge_batch else [16, "N", 10]}), {"stem": [2, 5], "feat": [0, 7]})


def test_time_major_outputs_count_macs_and_calibrate_batched(tmp_path: Path) -> None:
    model = _time_major()
    analysis = analyze(model)
    convs = 8 * 27 * 128 + 8 * 72 * 128
    assert analysis.macs.total == convs + 16 * 64 * 10  # per sample: the batch axis is axis 1 at the MatMul
    assert fixed_batch(model) is None
    calls = []
    real = cache.run_segment
    monkey = pytest.MonkeyPatch()
    monkey.setattr(cache, "run_segment", lambda *a, **k: (calls.append(k["batch_size"]), real(*a, **k))[1])
    try:
        pruned, report = compress_dead(model, tmp_path, {"stem": 6, "feat": 6}, (1, 3, 8, 16))
    finally:
        monkey.undo()
    assert report.fixed_batch is None and set(calls) == {32}
    same_outputs(pruned, model, (3, 3, 8, 16))


def test_a_batch_merged_with_time_is_said_and_calibrated_sample_by_sample(tmp_path: Path) -> None:
    model = _time_major(merge_batch=True)
    reason = fixed_batch(model).reason
    assert "flatten gives flatten_out shape [32, 64] at batch 2: the batch is merged with another dim" in reason
    pruned, _ = compress_dead(model, tmp_path, {"stem": 6}, (1, 3, 8, 16))
    same_outputs(pruned, model, (1, 3, 8, 16))


# ----------------------------------------------------------------------------- channels-last flatten


def _keras_head(classes: int = 5) -> onnx.ModelProto:
    """NHWC input → Transpose → conv (8) → conv ``last`` (8) → Transpose back to NHWC → Flatten → MatMul (MTCNN)."""
    b = GraphBuilder({"input": ["N", 8, 8, 3]})
    x = b.op("Transpose", ["input"], "to_nchw", perm=[0, 3, 1, 2])
    x = b.op("Relu", [b.conv(x, "first", 3, 8)], "first_act")
    x = b.op("Relu", [b.conv(x, "last", 8, 8)], "last_act")
    x = b.op("Flatten", [b.op("Transpose", [x], "to_nhwc", perm=[0, 2, 3, 1])], "flatten", axis=1)
    return kill(b.model({b.matmul(x, "dense", 8 * 8 * 8, classes): ["N", classes]}), {"first": [0, 5], "last": [1, 4]})


def test_a_channels_last_flatten_is_read_channels_first() -> None:
    model = _keras_head()
    assert _reason(model, "last") == "Flatten flatten: reshapes across the channel axis"
    rewritten = channels_first_heads(model)
    assert "to_nhwc" not in [n.name for n in rewritten.graph.node]
    x = np.random.default_rng(0).standard_normal((2, 8, 8, 3)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, input=x)[0], run(model, input=x)[0], rtol=1e-5, atol=1e-5)
    assert _reason(rewritten, "last") is None
    assert channels_first_heads(rewritten) is rewritten  # nothing left to rewrite: no round trip


def test_a_channels_last_flatten_is_found_without_copying_large_weights() -> None:
    """The pass reads shapes from a graph whose large weights are the model's own tensors (inferring shapes on a
    copy of the model cost VGG-11's load 0.6 s), and rewrites a head whose weight is exported by itself."""
    model = _keras_head(classes=600)  # dense.w: 512 × 600 floats, 1.2 MB
    dense = next(t for t in model.graph.initializer if t.name == "dense.w")
    assert dense.ByteSize() > EXPORT_BYTES
    graph = inferred_graph(model)
    assert graph.tensors()["dense.w"]._values.tensor is dense  # read in place, not loaded
    assert next(n for n in graph.nodes if n.name == "last_act").outputs[0].shape == ["N", 8, 8, 8]  # inferred
    rewritten = channels_first_heads(model)
    assert "to_nhwc" not in [n.name for n in rewritten.graph.node]
    x = np.random.default_rng(0).standard_normal((2, 8, 8, 3)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, input=x)[0], run(model, input=x)[0], rtol=1e-5, atol=1e-5)


def test_a_channels_last_flatten_head_prunes_to_the_original(tmp_path: Path) -> None:
    model = _keras_head()
    pruned, _ = compress_dead(channels_first_heads(model), tmp_path, {"first": 6, "last": 6}, (1, 8, 8, 3))
    same_outputs(pruned, model, (2, 8, 8, 3))


def test_flatten_channels_first_leaves_other_transposes() -> None:
    b = GraphBuilder({"input": ["N", 3, 4, 4]})
    x = b.op("Transpose", [b.conv("input", "c", 3, 2)], "t", perm=[0, 2, 3, 1])
    model = b.model({b.op("Flatten", [x], "f", axis=2): None})  # not a flatten of the whole sample
    graph = gs.import_onnx(onnx.shape_inference.infer_shapes(model))
    assert [n.op for n in flatten_channels_first(graph).nodes] == ["Conv", "Transpose", "Flatten"]


# ----------------------------------------------------------------------------- counts read at run time


def _paddle_neck() -> onnx.ModelProto:
    """conv ``a`` (8): its channel count read as ``Shape → Cast(int32) → Slice[1:2] → Cast`` into a Reshape
    target ``[0, C, -1]`` (then a MatMul over channels), its spatial size into a Resize of ``b`` (8, added to a)
    whose sizes also copy b's own batch and channel count (``Concat(Shape(b)[0:2], Shape(a)[2:4])``)."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]})
    a = b.op("Relu", [b.conv("input", "a", 3, 8)], "a_act")
    c = b.op("Relu", [b.conv("input", "b", 3, 8, stride=2)], "b_act")
    shape_a = b.op("Cast", [b.op("Shape", [a], "shape_a")], "shape_a32", to=TensorProto.INT32)

    def piece(src: str, start: int, end: int, name: str) -> str:
        part = b.op("Slice", [src, b.const(f"{name}.s", np.array([start]), np.int32),
                              b.const(f"{name}.e", np.array([end]), np.int32)], name)
        return b.op("Cast", [part], f"{name}64", to=TensorProto.INT64)

    channels = piece(shape_a, 1, 2, "count")
    target = b.op("Concat", [b.const("zero", np.array([0]), np.int64), channels,
                             b.const("rest", np.array([-1]), np.int64)], "target", axis=0)
    seq = b.op("Transpose", [b.op("Reshape", [a, target], "flat")], "nlc", perm=[0, 2, 1])
    proj = b.matmul(seq, "proj", 8, 4)
    shape_b = b.op("Cast", [b.op("Shape", [c], "shape_b")], "shape_b32", to=TensorProto.INT32)
    sizes = b.op("Concat", [piece(shape_b, 0, 2, "nc"), piece(shape_a, 2, 4, "hw")], "sizes", axis=0)
    up = b.op("Resize", [c, b.const("roi", np.zeros(0)), b.const("scales", np.zeros(0)), sizes], "up", mode="nearest")
    merged = b.conv(b.op("Add", [up, a], "merge"), "out", 8, 4)
    return kill(b.model({proj: ["N", 64, 4], merged: ["N", 4, 8, 8]}), {"a": [0, 3], "b": [0, 3]})


def test_counts_read_at_run_time_become_constants_the_pruning_rewrites(tmp_path: Path) -> None:
    model = _paddle_neck()
    analysis = analyze(model)
    assert "Shape" not in [n.op for n in analysis.graph.nodes if n.name == "shape_a"]
    group = next(g for g in analysis.groups if g.name == "a")  # b's upsampled output is added to a's
    assert group.prunable and group.producers == ["a", "b"], group.reason
    pruned, _ = compress_dead(model, tmp_path, {"a": 6}, (1, 3, 8, 8))
    targets = [onnx.numpy_helper.to_array(t).tolist() for t in pruned.graph.initializer if "target" in t.name]
    assert [0, 6, -1] in targets
    same_outputs(pruned, model, (2, 3, 8, 8))


# ----------------------------------------------------------------------------- words for what stays


def test_why_recurrent_and_output_groups_stay_is_said_in_words() -> None:
    b = GraphBuilder({"input": [1, 3, 4, 8]})
    feat = b.conv("input", "feat", 3, 6)
    seq = b.op("Reshape", [b.op("Transpose", [feat], "t", perm=[3, 0, 1, 2]),
                           b.const("target", np.array([8, 1, 24]), np.int64)], "seq")
    w = b.rand("lstm.w", (1, 16, 24), 0.1)
    r = b.rand("lstm.r", (1, 16, 4), 0.1)
    y = b.op("LSTM", [seq, w, r], "lstm", hidden_size=4)
    head = b.op("Reshape", [b.conv("input", "head", 3, 5), b.const("flat", np.array([1, 5, 32]), np.int64)], "head_flat")
    model = b.model({y: [8, 1, 1, 4], head: [1, 5, 32]})
    assert _reason(model, "feat") == ("LSTM lstm reads these channels as its input: a recurrent layer keeps its widths "
                                      "(its weights are not pruned)")
    assert _reason(model, "head") == "channels reach the graph output head_flat_out, which keeps its width"


# ----------------------------------------------------------------------------- the written model runs


def _drop_a_column(graph: gs.Graph) -> gs.Graph:
    """A pass broken on purpose: the first MatMul's weight loses a row (the pruning would have to drop the
    channel in its input too)."""
    node = next(n for n in graph.nodes if n.op == "MatMul")
    node.inputs[1] = gs.Constant(f"{node.name}.broken", np.asarray(node.inputs[1].values)[1:])
    return graph.cleanup().toposort()


def test_a_model_that_fails_in_onnxruntime_is_not_written(tmp_path: Path) -> None:
    model = _time_major()
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((8, 3, 8, 16)).astype(np.float32))
    result = api.compress(model, str(tmp_path / "calib.npy"), budget=Ratio(0.8), allocate=Uniform(), provider="cpu")
    good = tmp_path / "good.onnx"
    result.save(good)
    assert run(good, input=np.zeros((1, 3, 8, 16), np.float32))[0].shape == (16, 1, 10)
    broken = replace(result, model=gs.export_onnx(_drop_a_column(gs.import_onnx(result.model))))
    out = tmp_path / "pruned.onnx"
    with pytest.raises(ModelError, match=r"pruned.onnx: not written: the pruned model fails in onnxruntime at node "
                                         r"cls"):
        broken.save(out)
    assert not out.exists() and not list(tmp_path.glob(".pruned.onnx.*"))


def test_task_seq_reads_token_sequences_up_to_the_end_token() -> None:
    steps = np.zeros((2, 5, 4))
    steps[0, [0, 1, 2], [1, 2, 3]] = 1  # tokens 1 2 3(end) then padding
    steps[1, [0, 1, 2, 3, 4], [2, 1, 1, 2, 3]] = 1
    other = steps.copy()
    other[1, 1] = [0, 0, 1, 0]
    task = task_named("seq", [np.zeros((2, 5, 2)), steps], None, 2)
    assert task.output == 1
    metric = task.metric()
    metric.update([None, other], [None, steps])
    assert metric.result() == {"sequence_agreement_ref": 0.5, "token_agreement_ref": 1 - 1 / 8}


def test_task_seq_compares_the_steps_up_to_each_reference_end() -> None:
    steps = np.zeros((2, 5, 4))
    steps[0, [0, 1, 2, 3, 4], [1, 3, 2, 3, 0]] = 1  # ends at step 1: the rest is what the decoder ran past it
    steps[1, :, 2] = 1  # never ends
    task = task_named("seq", [steps], None, 2)
    past_end = steps.copy()
    past_end[0, 2:] = 5.0
    assert task.discrepancy([{"y": steps}], [{"y": past_end}]) == 0.0
    assert task.discrepancy([{"y": steps}], [{"y": steps[:, :2]}]) == pytest.approx(3 / 7)  # 3 steps of 7 missing


# ----------------------------------------------------------------------------- rows folded into the batch


@pytest.mark.parametrize(("batch", "computed"), [(1, False), ("N", False), ("N", True)])
def test_an_mlp_on_patches_folded_into_the_batch_is_pruned_to_the_original(batch: int | str, computed: bool,
                                                                          tmp_path: Path) -> None:
    """MobileViT's transformer MLP reads [4·N, 16, 16]: 4 patches a sample folded into the batch. Its hidden
    channels are cached ``[N, 4, 16, 12]`` between cuts and prune like any other (issue 71: "has no batch axis"),
    and so do the channels of the MatMul ``m0`` in front, through the fold's Reshape (the channel axis unchanged).
    ``computed``: the fold's target is ``[N·4, 16, 16]`` computed from the input's shape before the MatMul ``m0``
    in front, as torch.onnx writes ``reshape(B * 4, ...)``; it becomes the constant ``[-1, 16, 16]`` rather than a
    batch-less tensor cached at m0's cut."""
    b = GraphBuilder({"x": [batch, 64, 16]})
    if computed:
        n = b.op("Gather", [b.op("Shape", ["x"], "shape"), b.const("zero", np.array(0), np.int64)], "n", axis=0)
        rows = b.op("Unsqueeze", [b.op("Mul", [n, b.const("four", np.array(4), np.int64)], "rows"),
                                  b.const("axes", np.array([0]), np.int64)], "rows1")
        target = b.op("Concat", [rows, b.const("rest", np.array([16, 16]), np.int64)], "target", axis=0)
    else:
        target = b.const("fold", np.array([-1, 16, 16]), np.int64)
    fold = b.op("Reshape", [b.op("Relu", [b.matmul("x", "m0", 16, 16)], "act0"), target], "fold")
    hidden = b.op("Relu", [b.matmul(fold, "m1", 16, 12)], "act")
    out = b.op("Reshape", [b.matmul(hidden, "m2", 12, 8), b.const("back", np.array([-1, 512]), np.int64)], "back")
    model = b.model({out: [batch, 512]})
    for name, dead in (("m0.w", [1, 4, 7, 10]), ("m1.w", [2, 5, 8])):  # a quarter each: the uniform allocation
        weight = next(t for t in model.graph.initializer if t.name == name)
        w = numpy_helper.to_array(weight).copy()
        w[:, dead] = 0  # dead channels: the pruned model must equal the original
        weight.CopyFrom(numpy_helper.from_array(w, weight.name))
    pruned, _ = compress_dead(model, tmp_path, {"m0": 12, "m1": 9}, (1, 64, 16))
    same_outputs(pruned, model, (1, 64, 16))
