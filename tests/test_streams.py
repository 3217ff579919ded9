"""Residual streams pruned jointly: every producer's rows, every Add and every consumer's columns at once.

A stream (the outputs of several blocks summed by ``Add``s) is pruned at its first consumer; the consumers
that read it later are refitted when the loop reaches them. Checked against the ORIGINAL network with the
dropped channels masked at every consumer and, with the refit, the pruned consumers' weights written in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from onnxprune.analysis import analyze, consumers
from onnxprune.ir.shapes import infer_shapes
from onnxprune.analysis.groups import keep_index
from onnxprune.calib.sources import load_calibration
from onnxprune.pipeline import compress, schedule
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.cuts import Liveness
from onnxprune.strategies import Allocator, MACs, NoRefit, Refit, Selector, options_from
from tests.onnx_builders import masked_original, run


@dataclass(frozen=True)
class FirstChannels(Selector):
    """The first ``width`` channels, unscaled: which channels stay is then known to the test."""

    def select(self, ctx, group, data, width):
        return np.arange(width), np.ones(width), None


@dataclass(frozen=True)
class StreamsOnly(Allocator):
    """Half of every residual stream's channels; every other group whole."""

    needs_curves = False

    def widths(self, cost, groups, curves, target, min_channels, round_to):
        return {g.id: g.channels // 2 if g.coupled else g.channels for g in groups}


@dataclass(frozen=True)
class Halves(Allocator):
    """Half of every group's channels."""

    needs_curves = False

    def widths(self, cost, groups, curves, target, min_channels, round_to):
        return {g.id: max(1, g.channels // 2) for g in groups}


def _streams(model: onnx.ModelProto) -> list:
    analysis = analyze(model)
    order, _ = schedule(analysis, Liveness(analysis.graph), streams=True)
    return [g for _, g in order if g.coupled]


def _prune_streams(model: onnx.ModelProto, tmp_path, reconstruct) -> tuple[onnx.ModelProto, object, np.ndarray]:
    shape = model_input_specs(model)[0][1]
    x = np.random.default_rng(0).standard_normal((24, *shape[1:])).astype(np.float32)
    np.save(tmp_path / "calib.npy", x)
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    options = options_from(MACs(analyze(model).macs.total - 1), FirstChannels(), StreamsOnly(), reconstruct,
                           provider="cpu", round_to=1, residual_streams=True)
    pruned, report = compress(model, calib, options)
    return pruned, report, x


def _reference(model: onnx.ModelProto, pruned: onnx.ModelProto, streams: list, refit: bool) -> onnx.ModelProto:
    """The original with each stream's dropped channels masked at its consumers and, after a refit, each
    consumer's weights (its columns of the kept channels, zero for the dropped) and bias from the pruned model."""
    graph = analyze(model).graph.copy()  # as the pipeline reads it (shapes inferred, constants folded)
    if refit:
        mine = {n.name: n for n in graph.nodes}
        theirs = {n.name: n for n in gs.import_onnx(pruned).nodes}
        tensors = graph.tensors()
        for group in streams:
            for use in group.consumers:
                original, refitted = consumers.matrix(mine[use.node]), consumers.matrix(theirs[use.node])
                rows = len(refitted.bias)  # a stream producer's kept rows come first (FirstChannels)
                axis, repeat = group.tensors[use.tensor]
                entries = keep_index(tensors[use.tensor].shape[axis], group.offsets[use.tensor], group.channels,
                                     repeat, np.arange(group.channels // 2))  # the group at any offset(s)
                cols = (entries[:, None] * original.k + np.arange(original.k)).ravel()
                weight, bias = original.weight.copy(), original.bias.copy()
                weight[:rows], bias[:rows] = 0.0, refitted.bias
                weight[np.ix_(np.arange(rows), cols)] = refitted.weight
                consumers.write(graph, mine[use.node], consumers.Linear(weight, bias, original.k))
    for group in streams:
        masked = masked_original(graph, group, np.arange(group.channels) < group.channels // 2)
        graph = gs.import_onnx(infer_shapes(masked))
    return gs.export_onnx(graph)


CASES = [(name, kind) for name in ("tiny", "mobilenet_v2", "yolo_c2f") for kind in ("masked", "refit")] + [
    ("resnet34", "refit"), ("resnet50", "masked")]  # ResNet's 3x3 refits are the slow part: one of each


def _model(name: str, tiny, zoo, tmp_path) -> onnx.ModelProto:
    """The tiny model, a zoo model, or a small YOLO detector: its C2f blocks sum each bottleneck's output with
    one Split piece of the block's input, and concatenate every sum, so a stream is a range of the Split and
    sits at several offsets of the closing conv's input."""
    if name == "tiny":
        return tiny.model
    if name == "yolo_c2f":
        from models.build import randomise
        from models.yolo import Detector
        from tests.onnx_builders import export_torch

        return onnx.load(str(export_torch(randomise(Detector(classes=2, w=4)), tmp_path / "yolo.onnx", (1, 3, 64, 64))))
    return zoo.model(name)


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_pruned_streams_equal_the_masked_original(name: str, kind: str, tiny, zoo, tmp_path) -> None:
    reconstruct = Refit() if kind == "refit" else NoRefit()
    model = _model(name, tiny, zoo, tmp_path)
    streams = _streams(model)
    assert streams, "the model has residual streams to prune"
    pruned, report, x = _prune_streams(model, tmp_path, reconstruct)
    onnx.checker.check_model(pruned, full_check=True)
    assert {layer.group for layer in report.layers} == {g.name for g in streams}
    assert all(layer.kept == layer.channels // 2 for layer in report.layers)
    if isinstance(reconstruct, Refit):  # every consumer refitted, the later ones when the loop reached them
        assert [len(layer.ridges) for layer in report.layers] == [len(g.consumers) for g in streams]
    reference = _reference(model, pruned, streams, isinstance(reconstruct, Refit))
    (got,) = run(pruned, input=x[:8])
    (want,) = run(reference, input=x[:8])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    assert analyze(pruned).macs.total == report.macs_after < report.macs_before


@pytest.mark.parametrize("name", ["tiny", "mobilenet_v2", "yolo_c2f"])
def test_streams_and_the_blocks_on_them_pruned_together(name: str, tiny, zoo, tmp_path) -> None:
    """Every group pruned, streams included: a later block's projection (a stream producer whose rows were
    sliced) is refitted towards the original's kept rows, so its layer's error stays a fraction of its output."""
    model = _model(name, tiny, zoo, tmp_path)
    shape = model_input_specs(model)[0][1]
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((24, *shape[1:])).astype(np.float32))
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    options = options_from(MACs(analyze(model).macs.total - 1), allocate=Halves(), provider="cpu", round_to=1,
                           residual_streams=True)
    pruned, report = compress(model, calib, options)
    onnx.checker.check_model(pruned, full_check=True)
    assert {g.name for g in _streams(model)} <= {layer.group for layer in report.layers}
    assert all(0 <= layer.error < 1 for layer in report.layers), [(lay.group, lay.error) for lay in report.layers
                                                                  if not 0 <= lay.error < 1]



def _layer_norm_stream(channels_last: bool, pieces: int = 1) -> onnx.ModelProto:
    """ConvNeXt in miniature. ``channels_last``: a stem conv, then channels-last a stream of two producers (the stem
    and the MLP's second MatMul, summed by an Add) read through LayerNorms over the channels by the MLP and the head.
    Else ``pieces`` stem convs concatenated (several groups in one norm), a LayerNorm over [C, H, W] (its scale per
    entry) and a 1×1 head. The second half of every group's channels is dead (zeros), as ``FirstChannels`` prunes
    them: the masked original."""
    from tests.onnx_builders import GraphBuilder, kill

    b = GraphBuilder({"input": ["N", 3, 8, 8]})
    if not channels_last:
        names = ["stem"] if pieces == 1 else [f"stem{k}" for k in range(pieces)]
        stems = [b.conv("input", name, 3, 8 // pieces, 1) for name in names]
        stem = stems[0] if pieces == 1 else b.op("Concat", stems, "cat", axis=1)
        norm = b.op("LayerNormalization", [stem, b.rand("ln.g", (8, 8, 8)), b.rand("ln.b", (8, 8, 8))], "ln", axis=1)
        half = 4 // pieces
        return kill(b.model([b.conv(norm, "head", 8, 5, 1)]), {n: list(range(half, 2 * half)) for n in names})
    stem = b.conv("input", "stem", 3, 8, 1)
    s0 = b.op("Transpose", [stem], "nhwc", perm=[0, 2, 3, 1])
    norm = b.op("LayerNormalization", [s0, b.rand("ln1.g", (8,)), b.rand("ln1.b", (8,))], "ln1", axis=-1)
    hidden = b.op("Relu", [b.matmul(norm, "m1", 8, 16)], "act")
    s1 = b.op("Add", [s0, b.matmul(hidden, "m2", 16, 8)], "add")
    head = b.op("LayerNormalization", [s1, b.rand("ln2.g", (8,)), b.rand("ln2.b", (8,))], "ln2", axis=-1)
    model = kill(b.model([b.matmul(head, "head", 8, 5)]), {"stem": [4, 5, 6, 7]})
    for name, width in (("m1.w", 16), ("m2.w", 8)):  # a MatMul's output channels are its weight's columns
        weight = next(t for t in model.graph.initializer if t.name == name)
        w = onnx.numpy_helper.to_array(weight).copy()
        w[:, width // 2:] = 0
        weight.CopyFrom(onnx.numpy_helper.from_array(w, name))
    return model


@pytest.mark.parametrize(("channels_last", "pieces"), [(True, 1), (False, 1), (False, 2)])
def test_a_layer_norm_over_the_channels_prunes_to_the_masked_original(channels_last: bool, pieces: int,
                                                                      tmp_path) -> None:
    """The pruned norm normalises its kept channels padded back with zeros, so its mean and variance are the masked
    original's, where a dropped channel is a zero before the norm and dropped by its consumers after it (there it
    is not a zero: a norm's output is its bias less the scaled mean); with two groups in the norm, one pad for both.
    Issue 71: 'LayerNormalization is not known to be channel-wise' left ConvNeXt's streams and norms unpruned, and
    'normalises part of the channels' EdgeNeXt's."""
    model = _layer_norm_stream(channels_last, pieces)
    x = np.random.default_rng(0).standard_normal((12, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "calib.npy", x)
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    options = options_from(MACs(analyze(model).macs.total - 1), FirstChannels(), Halves(), NoRefit(),
                           provider="cpu", round_to=1, residual_streams=True)
    pruned, report = compress(model, calib, options)
    analysis = analyze(model)
    order, _ = schedule(analysis, Liveness(analysis.graph), streams=True)
    assert {layer.group for layer in report.layers} == {g.name for _, g in order} == (
        {"stem", "m1"} if channels_last else {"stem"} if pieces == 1 else {"stem0", "stem1"})
    assert {"Pad", "Slice"} <= {n.op_type for n in pruned.graph.node}
    assert sum(n.op_type == "Pad" for n in pruned.graph.node) == (2 if channels_last else 1)
    graph = analysis.graph.copy()
    for _, group in order:
        graph = gs.import_onnx(infer_shapes(masked_original(graph, group, np.arange(group.channels) <
                                                            group.channels // 2)))
    (got,) = run(pruned, input=x[:4])
    (want,) = run(gs.export_onnx(graph), input=x[:4])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_a_channels_last_stream_refits_the_consumer_before_its_add(tmp_path) -> None:
    """The MLP's second MatMul writes into the stream's Add: its refit's target moves by the stream's change, taken
    on its output's channel axis (the last, channels-last; axis 1 was taken and did not broadcast)."""
    model = _layer_norm_stream(channels_last=True)
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((24, 3, 8, 8)).astype(np.float32))
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    options = options_from(MACs(analyze(model).macs.total - 1), allocate=Halves(), provider="cpu", round_to=1,
                           residual_streams=True)
    _, report = compress(model, calib, options)
    assert {layer.group for layer in report.layers} == {"stem", "m1"}
    assert all(0 <= layer.error < 1 for layer in report.layers)
