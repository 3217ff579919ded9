"""The pre-flight: every candidate group pruned at once in a copy and run by onnxruntime before any statistic;
a group whose pruning breaks the run is isolated and excluded with onnxruntime's reason, in seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from typer.testing import CliRunner

import onnxprune
from onnxprune.analysis import analyze
from onnxprune.cli import app
from onnxprune.errors import AnalysisError
from onnxprune.ir.ort import ort_failure
from onnxprune.pipeline.preflight import _halve, _prefix, preflight
from tests.onnx_builders import GraphBuilder, export_torch, run


def resize_over_channels(healthy: bool = True) -> onnx.ModelProto:
    """conv a -> relu -> conv b -> Resize (opset 18, ``axes=[1, 2, 3]``, constant sizes that name the channel count)
    -> conv c. The registry reads the Resize as channel-wise (its input and output keep 8 channels), but pruning b's
    channels leaves the sizes asking for 8: onnxruntime's linear Resize refuses to resize the channel axis. Without
    ``healthy`` the input goes straight to conv b (no group but the broken one)."""
    b = GraphBuilder({"x": [1, 3, 16, 16]})
    b.opsets[""] = 18
    x = b.op("Relu", [b.conv("x", "a", 3, 8)], "relu_a") if healthy else "x"
    y = b.conv(x, "b", 8 if healthy else 3, 8)
    sizes = b.const("sizes", np.array([8, 32, 32]), np.int64)
    up = b.op("Resize", [y, "", "", sizes], "up", mode="linear", axes=[1, 2, 3])
    return b.model([b.conv(up, "c", 8, 4)])


def test_a_group_that_breaks_onnxruntime_is_excluded_with_its_reason() -> None:
    analysis = onnxprune.analyze(resize_over_channels())
    groups = {g.name: g for g in analysis.groups}
    assert groups["a"].prunable
    assert not groups["b"].prunable
    assert groups["b"].reason.startswith("pre-flight: pruned, the model fails in onnxruntime at node up:")
    assert "Linear" in groups["b"].reason
    assert list(analysis.preflight["excluded"]) == ["b"]


def test_preflight_leaves_the_graph_and_healthy_groups_alone() -> None:
    analysis = analyze(onnxprune.load(resize_over_channels()))
    before = gs.export_onnx(analysis.graph.copy()).SerializeToString()
    checked = preflight(analysis.graph, analysis.prunable)
    assert checked.excluded.keys() == {"b"} and checked.trials == 4  # all, each half, the rest again
    assert gs.export_onnx(analysis.graph.copy()).SerializeToString() == before
    assert [g.prunable for g in analysis.groups if g.name in ("a", "b")] == [True, False]


def test_isolating_a_failure_that_needs_two_groups_names_the_later_one() -> None:
    """A failure no group causes alone is traced by the shortest failing prefix."""
    groups = [g for g in analyze(onnxprune.load(resize_over_channels())).groups if g.prunable]

    def trial(subset):  # fails only when both groups are pruned together
        return "both" if len(subset) == 2 else None

    assert _halve(trial, groups, "both", deadline=time.monotonic() + 60, seconds=60) == []
    assert _prefix(trial, groups, "both") == [(groups[1], "both")]


def test_compress_prunes_around_the_broken_group(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(resize_over_channels(), model)
    calib = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    start = time.perf_counter()
    result = onnxprune.compress(str(model), calib, budget=onnxprune.Ratio(0.8))
    assert time.perf_counter() - start < 60
    kept = {layer.group: layer.kept for layer in result.report.layers}
    assert "b" not in kept and kept["a"] < 8
    assert any(s["group"] == "b" and s["reason"].startswith("pre-flight:") for s in result.report.skipped)
    assert result.report.preflight["excluded"].keys() == {"b"}
    result.save(tmp_path / "p.onnx")  # the written-model check runs it


def test_a_model_whose_every_group_breaks_is_refused_before_any_statistic(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(resize_over_channels(healthy=False), model)
    calib = np.zeros((4, 3, 16, 16), np.float32)
    with pytest.raises(AnalysisError, match="no prunable channel group.*pre-flight: pruned, the model fails"):
        onnxprune.compress(str(model), calib, budget=onnxprune.Ratio(0.8))


def test_analyze_shows_the_verdict(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(resize_over_channels(), model)
    out = CliRunner().invoke(app, ["analyze", str(model), "--json"])
    assert out.exit_code == 0, out.output
    info = json.loads(out.output)
    assert info["preflight"]["excluded"].keys() == {"b"}
    assert [g["prunable"] for g in info["groups"] if g["name"] in ("a", "b")] == [True, False]
    text = CliRunner().invoke(app, ["analyze", str(model)], env={"COLUMNS": "300"}).output
    assert "pre-flight: 2 groups pruned at once in a copy, 1 excluded" in text


@pytest.mark.parametrize("message, node, words", [
    ("[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Resize node. Name:'/Resize' "
     "Status Message: upsamplebase.h:553 ScalesValidation 'Linear' mode only supports:\n  * 2-D inputs",
     "/Resize", "'Linear' mode only supports: * 2-D inputs"),
    ("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Non-zero status code returned while running Conv node. "
     "Name:'c1' Status Message: Invalid input shape: {1,2}", "c1", "Invalid input shape: {1,2}"),
    ("[ONNXRuntimeError] : 10 : INVALID_GRAPH : Load model failed: Error in Node:add1 : No Op registered",
     "add1", "Load model failed: Error in Node:add1 : No Op registered"),
    ("something else", None, "something else"),
])
def test_ort_failure_names_the_node_and_says_the_rest_in_words(message: str, node: str | None, words: str) -> None:
    assert ort_failure(RuntimeError(message)) == (node, words)


class SkipSized(torch.nn.Module):
    """A U-Net's decoder as PyTorch exports it at a static batch: ``interpolate(x, size=skip.shape[2:])`` becomes a
    Resize whose constant ``sizes`` hold the batch and the channel count of the tensor it resizes (U²-Net style)."""

    def __init__(self) -> None:
        super().__init__()
        conv = lambda i, o: torch.nn.Sequential(torch.nn.Conv2d(i, o, 3, padding=1), torch.nn.ReLU())  # noqa: E731
        self.e1, self.e2, self.e3, self.d2, self.d1 = conv(3, 16), conv(16, 32), conv(32, 32), conv(64, 16), conv(32, 16)
        self.side = torch.nn.Conv2d(16, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        resize = lambda t, like: torch.nn.functional.interpolate(t, size=like.shape[2:], mode="bilinear")  # noqa: E731
        a = self.e1(x)
        b = self.e2(torch.nn.functional.max_pool2d(a, 2, ceil_mode=True))
        c = self.e3(torch.nn.functional.max_pool2d(b, 2, ceil_mode=True))
        d = self.d2(torch.cat([resize(c, b), b], 1))
        return torch.sigmoid(self.side(self.d1(torch.cat([resize(d, a), a], 1))))


def test_a_resize_sized_by_a_constant_is_pruned_through(tmp_path: Path) -> None:
    """The groups that reach a Resize of constant sizes are pruned (the sizes become the equal scales), and the
    pre-flight has nothing to exclude."""
    torch.manual_seed(0)
    path = export_torch(SkipSized(), tmp_path / "u.onnx", (1, 3, 30, 30), dynamic_batch=False)
    assert any(n.op_type == "Resize" and len(n.input) == 4 for n in onnx.load(path).graph.node)
    assert onnxprune.analyze(str(path)).preflight["excluded"] == {}  # as exported, batch 1: the sizes are constants
    calib = np.random.default_rng(0).standard_normal((8, 3, 30, 30)).astype(np.float32)
    result = onnxprune.compress(str(path), calib, budget=onnxprune.Ratio(0.6))
    assert result.report.preflight["excluded"] == {}
    kept = {layer.group: (layer.kept, layer.channels) for layer in result.report.layers}
    resized = [name for name in kept if name.startswith(("/e3/", "/d2/"))]
    assert resized and all(k < c for k, c in (kept[n] for n in resized))
    out = tmp_path / "p.onnx"
    result.save(out)
    assert run(out, input=calib[:1])[0].shape == (1, 1, 30, 30)


def test_a_group_that_would_cache_a_tensor_without_batch_axis_is_left_unpruned_before_any_work(tmp_path: Path) -> None:
    """conv a -> relu -> conv b -> relu -> conv c -> relu -> conv d, plus the input flattened to [B·768] (a tensor
    computed from the batch size, as a transformer's tokens flattened to [B·T, C]) and brought back to add to the
    output: alive at group a's cut, it cannot be cached across layers (the old code refused the model there, after
    the probes). Group a is left unpruned with the tensor named, before any statistic; b and c are pruned."""
    b = GraphBuilder({"x": ["N", 3, 16, 16]})
    y = b.op("Relu", [b.conv(b.op("Relu", [b.conv("x", "a", 3, 8)], "relu_a"), "b", 8, 8)], "relu_b")
    flat = b.op("Reshape", [b.op("Relu", ["x"], "early"), b.const("flat_shape", np.array([-1]), np.int64)], "flat")
    y = b.op("Relu", [b.conv(y, "c", 8, 8)], "relu_c")
    back = b.op("Reshape", [flat, b.const("back_shape", np.array([-1, 3, 16, 16]), np.int64)], "back")
    path = tmp_path / "m.onnx"
    onnx.save(b.model([b.op("Add", [b.conv(y, "d", 8, 3), back], "out")]), path)
    calib = np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)
    start = time.perf_counter()
    result = onnxprune.compress(str(path), calib, budget=onnxprune.Ratio(0.8))
    assert time.perf_counter() - start < 60
    kept = {layer.group: layer.kept for layer in result.report.layers}
    assert "a" not in kept and kept["b"] < 8 and kept["c"] < 8
    (reason,) = [s["reason"] for s in result.report.skipped if s["group"] == "a"]
    assert reason.startswith("tensor flat_out has no batch axis (shape [768] for a batch of 1")
    result.save(tmp_path / "p.onnx")  # the written-model check runs it
