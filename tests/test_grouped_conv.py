"""Grouped convolutions (not depthwise): a conv group is one unit of its channel space, kept or dropped whole,
so every kept group keeps its width and the conv its equal groups. Slicing equals the original with the dropped
groups' columns masked at the consumers, in onnxruntime; what cannot be pruned that way says why."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper
import pytest
import torch

from onnxprune import tables
from onnxprune.budget.allocation import check_target, group_step
from onnxprune.analysis import analyze
from onnxprune.calib.sources import load_calibration
from onnxprune.errors import TargetError
from onnxprune.ir.ort import model_input_specs
from onnxprune.pipeline import compress
from onnxprune.strategies import Ratio, options_from
from tests.onnx_builders import GraphBuilder, compress_dead, export_torch, kill, run, same_outputs
from tests.test_concat_split import check, groups_of


def bottleneck(se: bool = False, width_out: int = 24) -> tuple[GraphBuilder, str]:
    """ResNeXt's bottleneck: 1×1 (3 → 16) → BN → ReLU → 3×3 in 4 groups (16 → ``width_out``) → BN → ReLU
    [→ RegNetY's squeeze-excitation] → 1×1 (→ 8)."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.bn(b.conv("x", "conv1", 3, 16, k=1), "bn1", 16)], "r1")
    y = b.op("Relu", [b.bn(b.conv(y, "gconv", 16, width_out, group=4), "bn2", width_out)], "r2")
    if se:
        s = b.op("GlobalAveragePool", [y], "pool")
        s = b.op("Sigmoid", [b.conv(b.op("Relu", [b.conv(s, "se1", width_out, 4, k=1)], "rs"), "se2", 4, width_out,
                                    k=1)], "sig")
        y = b.op("Mul", [y, s], "excite")
    return b, b.conv(y, "conv3", width_out, 8, k=1)


@pytest.mark.parametrize("se", [False, True])
def test_a_grouped_conv_prunes_whole_conv_groups(se: bool) -> None:
    """The 1×1's 16 channels are 4 units of 4 (6 after the grouped conv): one group through the grouped conv
    (with the squeeze-excitation's expanding conv as a second producer); slicing two of them leaves a conv of 2
    groups, equal to the masked original."""
    b, out = bottleneck(se)
    groups = groups_of(b, [out])
    (g,) = groups["conv1"]
    assert g.prunable and g.channels == 4 and g.unit == 4 and "gconv" not in groups
    assert g.tensors["conv1_out"] == (1, 4) and g.tensors["gconv_out"] == (1, 6)
    assert g.producers == (["conv1", "se2"] if se else ["conv1"])
    assert sorted(c.node for c in g.consumers) == (["conv3", "se1"] if se else ["conv3"])
    graph = check(b.model([out]), ["conv1"])
    gconv = next(n for n in graph.nodes if n.name == "gconv")
    assert gconv.attrs["group"] == 2 and tuple(gconv.inputs[1].shape) == (12, 4, 3, 3)


def test_a_depthwise_conv_in_a_space_of_conv_groups_drops_a_groups_channels() -> None:
    """1×1 → depthwise → grouped conv (4 groups of 4): the depthwise conv is in the same space, its channels
    counted in units of 4; dropping two units drops 8 of its 16 groups."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "conv1", 3, 16, k=1)], "r1")
    y = b.op("Relu", [b.conv(y, "dw", 16, 16, group=16)], "r2")
    out = b.conv(b.conv(y, "gconv", 16, 16, group=4), "conv3", 16, 8, k=1)
    (g,) = groups_of(b, [out])["conv1"]
    assert g.prunable and g.channels == 4 and g.tensors["dw_out"] == (1, 4)
    graph = check(b.model([out]), ["conv1"])
    assert {n.name: n.attrs["group"] for n in graph.nodes if n.name in ("dw", "gconv")} == {"dw": 8, "gconv": 2}


def test_round_to_counts_channels_not_conv_groups() -> None:
    """``--round-to 8`` on groups of 8 channels steps one conv group at a time (RegNetY's 55 groups of 8 would
    otherwise narrow 64 channels a step), on groups of 4 two at a time."""
    assert group_step(55, 8, unit=8) == 1 and group_step(55, 8, unit=4) == 2 and group_step(55, 8) == 8
    assert group_step(8, 8, unit=4) == 2 and group_step(3, 8, unit=16) == 1


def test_an_unreachable_target_says_grouped_convs_count_whole_conv_groups() -> None:
    b, out = bottleneck()
    analysis = analyze(b.model([out]))
    with pytest.raises(TargetError, match=r"whole conv groups \(4 channels each\)"):
        check_target(analysis.macs, analysis.prunable, 1.0, min_channels=1)


def test_a_grouped_conv_reading_part_of_a_concat_is_blocked_with_its_reason() -> None:
    """Two convs concatenated into a grouped conv: neither range is whole conv groups of one producer."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    cat = b.op("Concat", [b.conv("x", "a", 3, 8, k=1), b.conv("x", "b", 3, 8, k=1)], "cat", axis=1)
    out = b.conv(b.conv(cat, "gconv", 16, 16, group=4), "head", 16, 8, k=1)
    groups = groups_of(b, [out])
    for name in ("a", "b"):
        (g,) = groups[name]
        assert not g.prunable and "grouped convolution (4 groups) reached by a space that is not whole" in g.reason


def test_a_space_of_conv_groups_pools_into_a_classifier() -> None:
    """FastViT's head: a conv's 6 channels widened by a conv grouped by input channel (each feeds 2 outputs), pooled
    by a ReduceMean over H, W (keepdims 0) into a Gemm. The pool is channel-wise in units of 2 entries (it blocked
    the stage's stream as "reduces over all axes"); slicing equals the masked original."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv(b.op("Relu", [b.conv("x", "conv1", 3, 6, k=1)], "r1"), "widen", 6, 12, group=6)], "r2")
    out = b.gemm(b.op("ReduceMean", [y], "pool", axes=[2, 3], keepdims=0), "fc", 12, 5)
    (g,) = groups_of(b, [out])["conv1"]
    assert g.prunable and g.tensors["pool_out"] == (1, 2), g.reason
    check(b.model([out]), ["conv1"])


def test_a_space_of_conv_groups_through_a_concat_slices_to_the_masked_original() -> None:
    """EfficientViT's attention: a conv's channels read by a grouped conv (so taken in whole conv groups) and
    concatenated with it: the group sits twice in the concatenation, 3 conv groups of 4 entries (it was blocked:
    "concatenates flattened channels or whole conv groups")."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    qkv = b.conv("x", "qkv", 3, 12, k=1)
    cat = b.op("Concat", [qkv, b.conv(qkv, "aggreg", 12, 12, k=1, group=3)], "cat", axis=1)
    out = b.conv(cat, "proj", 24, 8, k=1)
    (g,) = groups_of(b, [out])["qkv"]
    assert (g.channels, g.unit, g.prunable) == (3, 4, True), g.reason
    check(b.model([out]), ["qkv"])


def test_a_gate_of_one_conv_prunes_with_its_channels_to_the_masked_original(tmp_path) -> None:
    """VoVNet's effective squeeze-excitation: one 1×1 conv reads the pooled channels and gates the same channels.
    It is sliced in rows and columns with the group and not refitted (as a consumer it crashed the refit at timm's
    ese_vovnet19b widths, issue 71; then it blocked the group). Dead channels of the gated conv drop exactly."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "a", 3, 16, k=1)], "r")
    gate = b.op("HardSigmoid", [b.conv(b.op("GlobalAveragePool", [y], "gap"), "fc", 16, 16, k=1)], "hs")
    out = b.conv(b.op("Relu", [b.conv(b.op("Mul", [y, gate], "ese"), "mid", 16, 16, k=1)], "r2"), "head", 16, 8, k=1)
    model = kill(b.model([out]), {"a": [2, 9, 13]})
    groups = groups_of(b, [out])
    (g,) = groups["a"]
    assert g.prunable and g.gates == ["fc"] and g.producers == ["a"] and [c.node for c in g.consumers] == ["mid"]
    pruned, _ = compress_dead(model, tmp_path, {"a": 13}, (1, 3, 8, 8), fixed=True)
    dims = {i.name: list(i.dims) for i in pruned.graph.initializer}
    weights = {n.name: n.input[1] for n in pruned.graph.node if n.op_type == "Conv"}
    assert dims[weights["fc"]][:2] == [13, 13]
    same_outputs(pruned, model, (2, 3, 8, 8))


def test_a_gate_keeps_the_mean_of_what_its_dropped_inputs_added(tmp_path) -> None:
    """Channels that only feed the gate (no weight in the next conv) and hold a constant are dropped; what they added
    to the kept channels' gates moves into the gate's bias, so the pruned model still computes the original's."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "a", 3, 16, k=1)], "r")
    gate = b.op("HardSigmoid", [b.conv(b.op("GlobalAveragePool", [y], "gap"), "fc", 16, 16, k=1)], "hs")
    out = b.conv(b.op("Relu", [b.conv(b.op("Mul", [y, gate], "ese"), "mid", 16, 16, k=1)], "r2"), "head", 16, 8, k=1)
    model = b.model([out])
    inits = {t.name: t for t in model.graph.initializer}
    constant = [2, 9, 13]
    for name, edit in (("a.w", lambda w: w.__setitem__(constant, 0)), ("a.b", lambda w: w.__setitem__(constant, 1.0)),
                       ("mid.w", lambda w: w.__setitem__((slice(None), constant), 0))):
        w = numpy_helper.to_array(inits[name]).copy()
        edit(w)
        inits[name].CopyFrom(numpy_helper.from_array(w, name))
    pruned, _ = compress_dead(model, tmp_path, {"a": 13}, (1, 3, 8, 8), fixed=True)
    same_outputs(pruned, model, (2, 3, 8, 8))


class _ResNeXtBlock(torch.nn.Module):
    def __init__(self, c: int, width: int, groups: int) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(c, width, 1, bias=False), torch.nn.BatchNorm2d(width), torch.nn.ReLU(),
            torch.nn.Conv2d(width, width, 3, padding=1, groups=groups, bias=False), torch.nn.BatchNorm2d(width),
            torch.nn.ReLU(), torch.nn.Conv2d(width, c, 1, bias=False), torch.nn.BatchNorm2d(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.body(x))


def test_a_resnext_compresses_its_grouped_bottlenecks(tmp_path) -> None:
    """A small ResNeXt (two blocks of 8 groups of 4, warmed BatchNorm) at 0.8× its MACs: the bottlenecks narrow
    by whole conv groups, the grouped convs keep equal groups, and the output stays near the original's."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), _ResNeXtBlock(32, 32, 8),
                              _ResNeXtBlock(32, 32, 8), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(32, 10))
    x = torch.randn(64, 3, 16, 16)
    net.train()(x)  # warm the BatchNorm statistics
    model = onnx.load(export_torch(net, tmp_path / "resnext.onnx", (1, 3, 16, 16)))
    grouped = [g for g in analyze(model).groups if g.tensors.get(g.witness[0], (1, 1))[1] == 4]
    assert len(grouped) == 2 and all(g.prunable and g.channels == 8 for g in grouped)
    np.save(tmp_path / "calib.npy", x.numpy())
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    pruned, report = compress(model, calib, options_from(Ratio(0.8), provider="cpu"))
    convs = [n for n in pruned.graph.node if n.op_type == "Conv" and any(a.name == "group" and a.i > 1
                                                                         for a in n.attribute)]
    widths = {n.name: next(a.i for a in n.attribute if a.name == "group") for n in convs}
    assert len(widths) == 2 and min(widths.values()) < 8, widths
    for n in convs:  # every kept group keeps its 4 channels in and out
        w = next(i for i in pruned.graph.initializer if i.name == n.input[1])
        assert w.dims[1] == 4 and w.dims[0] == 4 * widths[n.name]
    layers = [x for x in report.layers if x.unit == 4]  # the report counts conv groups, and says how wide they are
    assert layers and all(layer.kept in widths.values() and layer.step == 2 for layer in layers)
    with tables.console.capture() as printed:
        tables.print_compress(report, "omp", "output", "refit", 8, tmp_path / "out.onnx")
    for layer in layers:  # the user reads channels (4 per conv group); two groups a step are --round-to 8's step
        assert f"{4 * layer.kept}/32 ({layer.kept}/8 conv groups)" in printed.get()
    assert "finer steps" not in printed.get()
    with tables.console.capture() as printed:
        tables.print_analysis(analyze(model), tmp_path / "resnext.onnx")
    assert printed.get().count("32 (8 conv groups)") == 2
    want = run(model, input=x[:8].numpy())[0]
    got = run(pruned, input=x[:8].numpy())[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.5
