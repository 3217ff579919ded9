"""A LayerNorm written out as elementwise ops (issue 71: EdgeNeXt's and ConvNeXt's channels-first norms, every norm
below opset 17) is fused into one ``LayerNormalization`` as the model loads, at any opset, so that the channels it
normalises prune; below opset 17, where the op does not exist, a result has it written out again. The oracle is
exactness: the channels a test removes are dead before the norm and unread after it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from onnx import helper, numpy_helper
from torch import nn

from onnxprune import api
from onnxprune.analysis import analyze
from onnxprune.ir.load import import_graph
from onnxprune.normal.write_layer_norm import write_layer_norm
from onnxprune.recovery.segments import find_segments
from tests.onnx_builders import compress_dead, export_torch, run, same_outputs

SHAPE = (1, 3, 8, 8)


class WrittenNorm(nn.Module):
    """A 1×1 stem of 8 channels, a norm over them written out (``first``: over axis 1 of NCHW, timm's LayerNorm2d;
    else over the last axis of NHWC), a 1×1 head of 5; stem channels 4–7 dead, unread by the head."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.first, self.stem, self.head = first, nn.Conv2d(3, 8, 1), nn.Linear(8, 5)
        self.weight, self.bias = nn.Parameter(torch.rand(8) + 0.5), nn.Parameter(torch.randn(8))
        with torch.no_grad():
            self.stem.weight[4:] = 0
            self.stem.bias[4:] = 0
            self.head.weight[:, 4:] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        axis = 1 if self.first else -1
        if not self.first:
            x = x.permute(0, 2, 3, 1)
        u = x.mean(axis, keepdim=True)
        x = (x - u) / torch.sqrt((x - u).pow(2).mean(axis, keepdim=True) + 1e-6)
        x = x * self.weight[:, None, None] + self.bias[:, None, None] if self.first else x * self.weight + self.bias
        return self.head(x.permute(0, 2, 3, 1) if self.first else x)


def _export(first: bool, opset: int, path: Path) -> onnx.ModelProto:
    torch.manual_seed(0)
    return onnx.load(str(export_torch(WrittenNorm(first), path, SHAPE, opset=opset)))


@pytest.mark.parametrize("first", [True, False])
def test_a_written_out_norm_is_fused_and_its_channels_prune_to_the_masked_original(first: bool, tmp_path: Path) -> None:
    original = _export(first, 17, tmp_path / "norm.onnx")
    assert sum(n.op_type == "ReduceMean" for n in original.graph.node) == 2
    model = api.load(original)
    ops = [n.op_type for n in model.graph.node]
    assert "ReduceMean" not in ops and ops.count("LayerNormalization") == 1
    x = np.random.default_rng(0).standard_normal((2, *SHAPE[1:])).astype(np.float32)
    np.testing.assert_allclose(run(model, input=x)[0], run(original, input=x)[0], rtol=1e-5, atol=1e-5)
    (stem,) = [g for g in analyze(model).groups if "stem" in g.name]
    assert stem.prunable, stem.reason
    pruned, _ = compress_dead(model, tmp_path, {stem.name: 4}, SHAPE)
    same_outputs(pruned, original, (2, *SHAPE[1:]))
    find_segments(import_graph(api.load(pruned)), import_graph(model))  # recover takes it: the norm's Pad and Slice


@pytest.mark.parametrize("first", [True, False])
def test_below_opset_17_the_norm_prunes_and_the_result_writes_it_out_again(first: bool, tmp_path: Path) -> None:
    original = _export(first, 13, tmp_path / "norm13.onnx")
    model = api.load(original)
    assert [n.op_type for n in model.graph.node].count("LayerNormalization") == 1  # onnxruntime runs it at opset 13
    (stem,) = [g for g in analyze(model).groups if "stem" in g.name]
    assert stem.prunable, stem.reason
    (unloaded,) = [g for g in analyze(original).groups if "stem" in g.name]  # the analysis alone does not fuse
    assert not unloaded.prunable and "a LayerNorm written out" in unloaded.reason, unloaded.reason
    pruned, report = compress_dead(model, tmp_path, {stem.name: 4}, SHAPE)
    written = api.Result(pruned, report).model
    ops = [n.op_type for n in written.graph.node]
    assert "LayerNormalization" not in ops and ops.count("ReduceMean") == 2
    assert [o.version for o in written.opset_import if o.domain in ("", "ai.onnx")] == [13]
    onnx.checker.check_model(written, full_check=True)
    same_outputs(written, original, (2, *SHAPE[1:]))
    find_segments(import_graph(api.load(written)), import_graph(model))  # fused again, the names of the teacher's


@pytest.mark.parametrize("axis", [-1, 1])
def test_write_layer_norm_matches_onnxruntime_s_norm_below_opset_17(axis: int) -> None:
    """The pass alone on a norm onnxruntime runs at opset 13: over the last axis, or over every axis from the
    channels on (the written form reduces them all); a scale of ones is not multiplied by."""
    rng = np.random.default_rng(0)
    shape = (2, 4, 3, 5)
    normed = shape[axis:]
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, shape)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, shape)
    for scale in (rng.uniform(0.5, 1.5, normed), np.ones(normed)):
        params = [numpy_helper.from_array(scale.astype(np.float32), "scale"),
                  numpy_helper.from_array(rng.standard_normal(normed).astype(np.float32), "bias")]
        node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=axis, epsilon=1e-3)
        fused = helper.make_model(helper.make_graph([node], "g", [x], [y], params),
                                  opset_imports=[helper.make_opsetid("", 13)])
        graph = write_layer_norm(gs.import_onnx(fused))
        ops = [n.op for n in graph.nodes]
        assert "LayerNormalization" not in ops and ops.count("Mul") == 1 + (not np.all(scale == 1))
        written = gs.export_onnx(graph)
        onnx.checker.check_model(written, full_check=True)
        feed = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(run(written, x=feed)[0], run(fused, x=feed)[0], rtol=1e-5, atol=1e-5)
