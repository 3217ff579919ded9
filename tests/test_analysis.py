"""Channel-group detection on the zoo architectures and hand-built graphs; MAC counting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import pytest

from onnxprune.analysis import analyze
from onnxprune.analysis.groups import Group
from onnxprune.ops.roles import AttrSite, SliceSite
from onnxprune.errors import AnalysisError, ModelError
from onnxprune.ir.load import load_model
from onnxprune.passes import slice_channels
from onnxprune.ir.ort import weights_aside, graph_session, make_session
from onnxprune.ir.graph import EXPORT_BYTES, export_model, large_constants, loaded
from onnxprune.ir.probe import run_all_tensors
from onnxprune.ir.shapes import infer_shapes, onnx_infer
from onnxprune.analysis.groups import find_groups
from onnxprune.analysis.macs import MacModel, count_params
from tests.onnx_builders import GraphBuilder, export_graph, masked_original, run


def by_producer(groups: list[Group], node: str) -> Group:
    """The group that ``node`` produces channels for."""
    found = [g for g in groups if node in g.producers]
    assert len(found) == 1, f"{node} produces {len(found)} groups"
    return found[0]


def consumers(group: Group) -> list[str]:
    return [c.node for c in group.consumers]


def assert_single(group: Group, producer: str, consumer: list[str], channels: int | None = None) -> None:
    assert group.prunable, group.reason
    assert not group.coupled
    assert group.producers == [producer]
    assert consumers(group) == consumer
    if channels is not None:
        assert group.channels == channels


# ---------------------------------------------------------------- zoo architectures

MBV2_STAGES = [(1, 16, 1), (6, 24, 2), (6, 32, 3), (6, 64, 4), (6, 96, 3), (6, 160, 3), (6, 320, 1)]  # t, c, n


def test_mobilenet_v2_groups(zoo) -> None:
    groups = zoo.analysis("mobilenet_v2").groups
    f = "/features/features.{}".format
    stem = f"{f(0)}/features.0.0/Conv"
    # First block (t=1): the stem's 32 channels go through the depthwise conv to the projection.
    g = by_producer(groups, stem)
    assert_single(g, stem, [f"{f(1)}/conv/conv.1/Conv"], 32)
    assert AttrSite(f"{f(1)}/conv/conv.0/conv.0.0/Conv", "group") in g.attrs
    # Every other block: expansion channels -> depthwise -> projection, one producer.
    in_ch, block = 16, 2
    for t, c, n in MBV2_STAGES[1:]:
        for _ in range(n):
            expand = f"{f(block)}/conv/conv.0/conv.0.0/Conv"
            g = by_producer(groups, expand)
            assert_single(g, expand, [f"{f(block)}/conv/conv.2/Conv"], in_ch * t)
            assert AttrSite(f"{f(block)}/conv/conv.1/conv.1.0/Conv", "group") in g.attrs
            in_ch, block = c, block + 1
    # Residual streams: one coupled group per stage with n > 1, produced by every block's projection.
    block = 1
    for t, c, n in MBV2_STAGES:
        projections = [f"{f(b)}/conv/conv.{1 if t == 1 else 2}/Conv" for b in range(block, block + n)]
        g = by_producer(groups, projections[0])
        assert g.channels == c
        assert sorted(g.producers) == sorted(projections)
        assert g.coupled == (n > 1)
        block += n
    # Last 1280 channels -> GlobalAveragePool -> Flatten -> Gemm, one column per channel.
    head = by_producer(groups, f"{f(18)}/features.18.0/Conv")
    assert_single(head, f"{f(18)}/features.18.0/Conv", ["/classifier/classifier.1/Gemm"], 1280)
    assert head.consumers[0].repeat == 1
    assert len(head.tensors) >= 4  # conv, clip, pool, flatten outputs
    logits = by_producer(groups, "/classifier/classifier.1/Gemm")
    assert not logits.prunable and "graph output" in logits.reason


@pytest.mark.parametrize("name", ["resnet34", "resnet50"])
def test_resnet_inner_channels_are_prunable(zoo, name: str) -> None:
    groups = zoo.analysis(name).groups
    bottleneck = name == "resnet50"
    inner = 0
    for stage, blocks in enumerate([3, 4, 6, 3], start=1):
        stream = None
        for b in range(blocks):
            p = f"/layer{stage}/layer{stage}.{b}"
            assert_single(by_producer(groups, f"{p}/conv1/Conv"), f"{p}/conv1/Conv", [f"{p}/conv2/Conv"],
                          64 * 2 ** (stage - 1))
            inner += 1
            last = f"{p}/conv2/Conv"
            if bottleneck:
                assert_single(by_producer(groups, last), last, [f"{p}/conv3/Conv"], 64 * 2 ** (stage - 1))
                inner += 1
                last = f"{p}/conv3/Conv"
            g = by_producer(groups, last)  # the residual stream this block writes to
            assert g.coupled and g.prunable
            stream = stream or g
            assert g is stream, "every block of a stage adds into the same stream"
        # + the downsample conv, or (ResNet-34's first stage) the stem whose output is the stream
        assert len(stream.producers) == blocks + 1
        assert ("/conv1/Conv" in stream.producers) == (stage == 1 and not bottleneck)
    assert inner == (32 if bottleneck else 16)
    fc = by_producer(groups, "/fc/Gemm")
    assert not fc.prunable


def _vgg_conv_nodes() -> list[str]:
    from models.vgg import _VGG11

    names, index = [], 0
    for v in _VGG11:
        if v == "M":
            index += 1
        else:
            names.append(f"/features/features.{index}/Conv")
            index += 2
    return names


def _check_vgg(groups: list[Group], first_fc: str) -> None:
    convs = _vgg_conv_nodes()
    assert len(convs) == 8
    for conv, nxt in zip(convs, convs[1:]):
        assert_single(by_producer(groups, conv), conv, [nxt])
    last = by_producer(groups, convs[-1])
    assert_single(last, convs[-1], [first_fc], 512)
    assert last.consumers[0].repeat == 49  # Flatten of 512x7x7: 49 Gemm columns per channel
    assert SliceSite(first_fc, 1, 1, 49) in last.slices


def test_vgg11_conv_stack(zoo) -> None:
    """VGG-11's conv stack (models.vgg config) with a small classifier: every conv output is prunable."""
    _check_vgg(zoo.analysis("vgg11_features").groups, "/classifier/classifier.0/Gemm")


def test_vgg11_full(zoo) -> None:
    """The whole VGG-11 (4096-wide classifier, 133M parameters: the suite's slowest analysis)."""
    groups = zoo.analysis("vgg11").groups
    _check_vgg(groups, "/classifier/classifier.0/Gemm")
    assert by_producer(groups, "/classifier/classifier.0/Gemm").prunable


def test_mobilenet_v3_small_se(zoo) -> None:
    from models.mobilenet_v3 import _SMALL

    groups = zoo.analysis("mobilenet_v3_small").groups
    prev_out = "/features/features.0/features.0.0/Conv"
    for i, cfg in enumerate(_SMALL, start=1):
        p = f"/features/features.{i}/block"
        has_expand = cfg.exp_ch != cfg.in_ch
        expand = f"{p}/block.0/block.0.0/Conv" if has_expand else prev_out
        project = f"{p}/block.{2 + cfg.use_se + has_expand - 1}/block.{2 + cfg.use_se + has_expand - 1}.0/Conv"
        if cfg.use_se:
            se = f"{p}/block.{1 + has_expand}"
            assert_single(by_producer(groups, f"{se}/fc1/Conv"), f"{se}/fc1/Conv", [f"{se}/fc2/Conv"])
            g = by_producer(groups, f"{se}/fc2/Conv")
            assert g is by_producer(groups, expand), "the SE gate's output and the gated channels are one group"
            assert g.coupled and g.prunable
            assert g.channels == cfg.exp_ch
            assert f"{se}/fc1/Conv" in consumers(g) and project in consumers(g)
        elif has_expand:
            assert_single(by_producer(groups, expand), expand, [project], cfg.exp_ch)
        prev_out = project


# ---------------------------------------------------------------- hand-built graphs


def analyse(b: GraphBuilder, outputs) -> dict[str, Group]:
    model = b.model(outputs)
    onnx.checker.check_model(model)
    return {g.name: g for g in analyze(model).groups}


def check_slicing(model: onnx.ModelProto, group_name: str, keep: list[int], feeds: dict[str, np.ndarray]) -> None:
    """Slicing ``keep`` gives the original model with the other channels zeroed at the consumers."""
    analysis = analyze(model)
    group = next(g for g in analysis.groups if g.name == group_name)
    mask = np.zeros(group.channels)
    mask[keep] = 1.0
    reference = run(masked_original(analysis.graph, group, mask), **feeds)
    pruned = export_graph(slice_channels(analysis.graph.copy(), group, np.array(keep)))
    for got, want in zip(run(pruned, **feeds), reference):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


X = {"x": np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)}


def test_residual_add_is_coupled() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    r = b.op("Relu", [b.conv("x", "stem", 3, 8)], "r0")
    y = b.conv(b.op("Relu", [b.conv(r, "c1", 8, 6)], "r1"), "c2", 6, 8)
    s = b.op("Add", [r, y], "add")
    out = b.conv(b.op("Relu", [s], "r2"), "head", 8, 4)
    groups = analyse(b, [out])
    g = groups["stem"]
    assert g.coupled and g.prunable and sorted(g.producers) == ["c2", "stem"]
    assert sorted(consumers(g)) == ["c1", "head"]
    assert_single(groups["c1"], "c1", ["c2"], 6)
    check_slicing(b.model([out]), "stem", [0, 3, 4, 7], X)


def test_concat_on_other_axis_is_channelwise() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "a", 3, 8)], "r")
    cat = b.op("Concat", [y, y], "cat", axis=2)
    out = b.conv(cat, "c", 8, 4)
    groups = analyse(b, [out])
    assert_single(groups["a"], "a", ["c"], 8)


def test_depthwise_conv_is_channelwise() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "a", 3, 8)], "r")
    dw = b.op("Relu", [b.conv(y, "dw", 8, 8, group=8, stride=2)], "r2")
    out = b.conv(dw, "c", 8, 4, k=1)
    model = b.model([out])
    groups = analyse(b, [out])
    g = groups["a"]
    assert_single(g, "a", ["c"], 8)
    assert "dw" not in groups  # a depthwise conv creates no channel space of its own
    assert "dw_out" in g.tensors
    assert AttrSite("dw", "group") in g.attrs
    assert SliceSite("dw", 1, 0) in g.slices and SliceSite("dw", 2, 0) in g.slices
    check_slicing(model, "a", [1, 2, 6], X)


def test_grouped_conv_carries_whole_groups() -> None:
    """A grouped conv passes its conv groups (units of 4 channels in, 2 out; ``tests/test_grouped_conv.py``): here
    on to the graph output, which keeps its width."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    out = b.conv(b.conv("x", "a", 3, 8), "g", 8, 4, group=2)
    g = analyse(b, [out])["a"]
    assert g.channels == 2 and g.tensors[out] == (1, 2)
    assert not g.prunable and "graph output" in g.reason


def test_se_gate_is_coupled() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "a", 3, 8)], "r")
    pooled = b.op("GlobalAveragePool", [y], "gap")
    gate = b.op("Sigmoid", [b.conv(b.op("Relu", [b.conv(pooled, "fc1", 8, 4, k=1)], "r1"), "fc2", 4, 8, k=1)], "sig")
    out = b.conv(b.op("Mul", [y, gate], "scale"), "c", 8, 5, k=1)
    model = b.model([out])
    groups = analyse(b, [out])
    g = groups["a"]
    assert g.coupled and g.prunable
    assert sorted(g.producers) == ["a", "fc2"]
    assert sorted(consumers(g)) == ["c", "fc1"]
    assert_single(groups["fc1"], "fc1", ["fc2"], 4)
    check_slicing(model, "a", [0, 5, 6, 7], X)
    check_slicing(model, "fc1", [2], X)


def test_hardswish_decomposed_with_broadcast_constants() -> None:
    """x * Clip(x + 3, 0, 6) / 6 with scalar and [1]-shaped constants stays one channel-wise space."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.conv("x", "a", 3, 8)
    shifted = b.op("Add", [y, b.const("three", 3.0)], "add3")
    clipped = b.op("Clip", [shifted, b.const("zero", 0.0), b.const("six", 6.0)], "clip")
    hs = b.op("Div", [b.op("Mul", [y, clipped], "mul"), b.const("six_1", np.array([6.0]))], "div")
    out = b.conv(hs, "c", 8, 4)
    model = b.model([out])
    g = analyse(b, [out])["a"]
    assert_single(g, "a", ["c"], 8)
    assert {"add3_out", "clip_out", "mul_out", "div_out"} <= set(g.tensors)
    assert not any(s.node in ("add3", "clip", "div") for s in g.slices), "scalar constants are not sliced"
    check_slicing(model, "a", [0, 1, 5], X)


def test_per_channel_constant_mul_is_sliced() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Mul", [b.conv("x", "a", 3, 8), b.rand("s", (1, 8, 1, 1))], "mul")
    out = b.conv(y, "c", 8, 4)
    model = b.model([out])
    g = analyse(b, [out])["a"]
    assert_single(g, "a", ["c"], 8)
    assert SliceSite("mul", 1, 1) in g.slices
    check_slicing(model, "a", [2, 3, 4, 7], X)


def test_unfolded_batchnorm_mul_add() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Mul", [b.conv("x", "a", 3, 8, bias=False), b.rand("bn_s", (8, 1, 1))], "bn_mul")
    y = b.op("Relu", [b.op("Add", [y, b.rand("bn_b", (8, 1, 1))], "bn_add")], "r")
    out = b.conv(y, "c", 8, 4)
    model = b.model([out])
    g = analyse(b, [out])["a"]
    assert_single(g, "a", ["c"], 8)
    assert SliceSite("bn_mul", 1, 0) in g.slices and SliceSite("bn_add", 1, 0) in g.slices
    check_slicing(model, "a", [0, 4], X)


def test_batchnorm_node_is_sliced() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.bn(b.conv("x", "a", 3, 8, bias=False), "bn", 8)], "r")
    out = b.conv(y, "c", 8, 4)
    model = b.model([out])
    g = analyse(b, [out])["a"]
    assert {SliceSite("bn", i, 0) for i in range(1, 5)} <= set(g.slices)
    check_slicing(model, "a", [1, 3, 5, 7], X)


def test_weights_in_constant_nodes() -> None:
    rng = np.random.default_rng(0)
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    for name, shape in (("w1", (8, 3, 3, 3)), ("w2", (4, 8, 1, 1))):
        value = onnx.numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), f"{name}.v")
        b.nodes.append(onnx.helper.make_node("Constant", [], [name], name=f"{name}_const", value=value))
    y = b.op("Relu", [b.op("Conv", ["x", "w1"], "a", pads=[1, 1, 1, 1])], "r")
    out = b.op("Conv", [y, "w2"], "c")
    model = b.model([out])
    g = analyse(b, [out])["a"]
    assert_single(g, "a", ["c"], 8)
    check_slicing(model, "a", [0, 2, 3], X)


def test_softmax_over_channels_blocks() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    out = b.conv(b.op("Softmax", [b.conv("x", "a", 3, 8)], "sm", axis=1), "c", 8, 4)
    g = analyse(b, [out])["a"]
    assert not g.prunable
    assert "Softmax" in g.reason and "sm" in g.reason


def test_softmax_over_space_is_channelwise() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    out = b.conv(b.op("Softmax", [b.conv("x", "a", 3, 8)], "sm", axis=3), "c", 8, 4)
    assert_single(analyse(b, [out])["a"], "a", ["c"], 8)


def test_custom_domain_op_blocks_with_its_name() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("FancyNorm", [b.conv("x", "a", 3, 8)], "fancy", domain="com.example")
    b.declare(y, ["batch", 8, 8, 8])  # a custom op's output shape only comes from value_info
    out = b.conv(y, "c", 8, 4)
    g = analyse(b, [out])["a"]
    assert not g.prunable
    assert "FancyNorm" in g.reason and "fancy" in g.reason


def test_custom_domain_op_without_shapes_names_the_op() -> None:
    """Shape inference stops at an unknown op: the MACs in front of it are counted, those after it are not, and
    the analysis names the op where static shapes end."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("FancyNorm", [b.conv("x", "a", 3, 8)], "fancy", domain="com.example")
    out = b.conv(y, "c", 8, 4)
    analysis = analyze(b.model([out]))
    assert analysis.macs.total == 8 * 8 * 8 * 3 * 9  # conv a alone
    assert analysis.macs.unknown == ["Conv c: unknown shapes: static shapes end at FancyNorm (domain com.example) fancy"]
    assert analysis.to_dict()["macs_unknown_shapes"] == analysis.macs.unknown


def test_a_graph_whose_every_mac_is_unknown_is_refused_naming_the_op() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("FancyNorm", ["x"], "fancy", domain="com.example")
    out = b.conv(b.op("Relu", [b.conv(y, "a", 3, 8)], "r"), "c", 8, 4)
    with pytest.raises(AnalysisError, match="static shapes end at FancyNorm"):
        analyze(b.model([out]))


def test_channels_reaching_graph_output() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    r = b.op("Relu", [b.conv("x", "a", 3, 8)], "r")
    out = b.conv(r, "c", 8, 4)
    g = analyse(b, [out, r])["a"]
    assert not g.prunable
    assert "graph output" in g.reason and "r_out" in g.reason


def test_matmul_chain_groups() -> None:
    b = GraphBuilder({"x": ["batch", 5, 6]})
    h = b.op("Relu", [b.op("Add", [b.matmul("x", "m1", 6, 10), b.rand("m1.b", (10,))], "m1_add")], "r")
    out = b.matmul(h, "m2", 10, 3)
    g = analyse(b, [out])["m1"]
    assert_single(g, "m1", ["m2"], 10)
    assert SliceSite("m1_add", 1, 0) in g.slices and SliceSite("m2", 1, 0) in g.slices


# ---------------------------------------------------------------- MACs


def test_mac_counts_by_hand() -> None:
    b = GraphBuilder({"x": [1, 4, 17, 17], "y": [1, 3, 10]})
    c1 = b.conv("x", "c1", 4, 8, 3, stride=2, pad=1)  # 17 -> 9
    c2 = b.conv(c1, "c2", 8, 8, 3, group=2)  # 9x9, 4 input channels per group
    c3 = b.conv(c2, "c3", 8, 6, 3, dilation=2, pad=0)  # 9 - 2*2 = 5
    ct = b.op("ConvTranspose", [c3, b.rand("ct.w", (6, 5, 2, 2))], "ct", strides=[2, 2])  # 5 -> 10
    flat = b.op("Flatten", [b.op("GlobalAveragePool", [ct], "gap")], "flat")
    g1 = b.gemm(flat, "g1", 5, 7, trans_b=0)
    g2 = b.gemm(g1, "g2", 7, 2, trans_b=1)
    mm = b.matmul("y", "mm", 10, 4)
    analysis = analyze(b.model([g2, mm]))
    macs = {e.node: e.macs for e in analysis.macs.entries}
    assert macs == {
        "c1": 8 * 9 * 9 * 4 * 3 * 3,
        "c2": 8 * 9 * 9 * 4 * 3 * 3,
        "c3": 6 * 5 * 5 * 8 * 3 * 3,
        "ct": 6 * 5 * 5 * 5 * 2 * 2,
        "g1": 5 * 7,
        "g2": 7 * 2,
        "mm": 3 * 10 * 4,
    }
    assert analysis.macs.total == sum(macs.values())
    # ConvTranspose produces channels (weight sliced on axis 1) and consumes them (axis 0).
    ct_group = next(g for g in analysis.groups if g.name == "ct")
    assert SliceSite("ct", 1, 1) in ct_group.slices
    c3_group = next(g for g in analysis.groups if g.name == "c3")
    assert c3_group.prunable and [(c.node, c.kind) for c in c3_group.consumers] == [("ct", "conv_transpose")]
    assert SliceSite("ct", 1, 0) in c3_group.slices


@pytest.mark.parametrize("batch", [1, 2, "batch"])
def test_a_first_axis_folding_patches_into_the_batch_counts_them_all(batch: int | str) -> None:
    """MobileViT folds 4 patches a sample into the first axis ([4·N, 16, 16]): every fold counts (4 × 16 × 16 × 8
    per sample), at a static batch and a dynamic one (read from shape inference at batch 1 and 2)."""
    b = GraphBuilder({"x": [batch, 64, 16]})
    shape = b.const("shape", np.array([-1, 16, 16]), np.int64)
    mm = b.matmul(b.op("Reshape", ["x", shape], "fold"), "mm", 16, 8)
    (entry,) = analyze(b.model([mm])).macs.entries
    assert entry.macs == 4 * 16 * 16 * 8


def _prune_randomly(analysis, rng: np.random.Generator) -> tuple[dict[int, int], onnx.ModelProto]:
    graph = analysis.graph.copy()
    widths = {}
    for g in analysis.prunable:
        widths[g.id] = int(rng.integers(1, g.channels + 1))
        graph = slice_channels(graph, g, rng.choice(g.channels, widths[g.id], replace=False))
    return widths, export_graph(graph)


@pytest.mark.parametrize("name", ["mobilenet_v2", "mobilenet_v3_small"])
def test_mac_model_matches_pruned_zoo_model(zoo, name: str) -> None:
    analysis = zoo.analysis(name)
    widths, pruned = _prune_randomly(analysis, np.random.default_rng(0))
    after = analyze(pruned)
    assert after.macs.total == pytest.approx(analysis.macs.macs(widths), rel=1e-12)
    assert after.macs.total < analysis.macs.total
    x = np.random.default_rng(0).standard_normal((2, 3, 64, 64)).astype(np.float32)
    (logits,) = run(pruned, input=x)
    assert logits.shape == (2, 1000) and np.isfinite(logits).all()


def test_mac_model_matches_pruned_hand_graph() -> None:
    b = GraphBuilder({"x": ["batch", 3, 16, 16]})
    r = b.op("Relu", [b.conv("x", "stem", 3, 8, stride=2)], "r0")
    e = b.op("Relu", [b.conv(r, "expand", 8, 24, k=1)], "r1")
    d = b.op("Relu", [b.conv(e, "dw", 24, 24, group=24)], "r2")
    s = b.op("Add", [r, b.conv(d, "project", 24, 8, k=1)], "add")
    flat = b.op("Flatten", [b.op("Relu", [b.conv(s, "head", 8, 12, stride=2)], "r3")], "flat")  # 12 x 4 x 4
    out = b.gemm(flat, "fc", 12 * 16, 5)
    analysis = analyze(b.model([out]))
    assert len(analysis.prunable) == 3
    for seed in range(3):
        widths, pruned = _prune_randomly(analysis, np.random.default_rng(seed))
        assert analyze(pruned).macs.total == pytest.approx(analysis.macs.macs(widths), rel=1e-12)
        assert run(pruned, x=np.ones((3, 3, 16, 16), np.float32))[0].shape == (3, 5)
        fresh = analyze(b.model([out])).macs  # its own memo holds none of the widths asked above
        for g in analysis.prunable:  # one width changed at a time, as an allocation asks
            narrowed = {**widths, g.id: 1}
            assert analysis.macs.macs(narrowed) == fresh.macs(narrowed)


def test_the_op_registry_refuses_a_second_entry_for_an_op() -> None:
    from onnxprune.ops import OpEntry, lookup, register

    conv = lookup("Conv")
    with pytest.raises(ValueError, match=r"Conv is already registered \(channels=_conv_rule, .*torch=\{1: _conv\}"):
        register(OpEntry("Conv", channels=lambda *args: None))
    assert lookup("Conv") is conv

def test_shape_inference_reads_the_weights_shapes_only() -> None:
    """``onnx_infer`` leaves the weights out of what it hands to onnx (as inputs of their shape) and gives what onnx's
    inference gives on the whole model: shapes through a weight, a Reshape target propagated from a Shape, and the
    weights themselves unchanged; one weight declared as a graph input too (old exporters list them)."""
    b = GraphBuilder({"x": [1, 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "conv", 3, 64)], "relu")
    shape = b.op("Shape", [y], "shape")
    first = b.op("Gather", [shape, b.const("zero", np.array([0]), np.int64)], "first", axis=0)
    target = b.op("Concat", [first, b.const("rest", np.array([-1]), np.int64)], "target", axis=0)
    flat = b.op("Reshape", [y, target], "flat")
    out = b.gemm(flat, "fc", 64 * 8 * 8, 10)
    model = b.model({out: None})
    weight = next(t for t in model.graph.initializer if t.name == "fc.w")
    model.graph.input.append(onnx.helper.make_tensor_value_info(weight.name, weight.data_type, weight.dims))
    model.graph.output[0].type.tensor_type.ClearField("shape")
    got, want = onnx_infer(model, data_prop=True), onnx.shape_inference.infer_shapes(model, data_prop=True)
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*got.graph.value_info, *got.graph.output]}
    assert shapes[flat] == [1, 4096] and shapes[out] == [1, 10]


def test_sessions_take_large_weights_beside_the_model_bytes() -> None:
    """``make_session`` (a ModelProto) and ``graph_session`` (a graph) hand weights of ``WEIGHT_BYTES`` or more to
    onnxruntime as arrays (the serialised model holds a stub) and compute what the model does from its bytes; the
    graph comes back with its own constants."""
    b = GraphBuilder({"x": [2, 600]})
    h = b.op("Relu", [b.gemm("x", "fc1", 600, 512)], "relu")  # fc1.w: 1.2 MB
    out = b.gemm(h, "fc2", 512, 10)
    model = b.model({out: None})
    light, weights = weights_aside(model)
    assert list(weights) == ["fc1.w"] and weights["fc1.w"].shape == (512, 600)
    stub = next(t for t in light.graph.initializer if t.name == "fc1.w")
    assert stub.data_location == onnx.TensorProto.EXTERNAL and not stub.raw_data
    x = np.random.default_rng(0).standard_normal((2, 600)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(make_session(model, "cpu")[0].run(None, {"x": x})[0], want)
    graph = gs.import_onnx(model)
    before = [id(t) for n in graph.nodes for t in n.inputs]
    np.testing.assert_array_equal(graph_session(graph, "cpu")[0].run(None, {"x": x})[0], want)
    assert [id(t) for n in graph.nodes for t in n.inputs] == before
    tensors = run_all_tensors(model, [h, out], {"x": x})  # a session run once: the weights not pre-packed
    np.testing.assert_allclose(tensors[out], want, rtol=1e-5, atol=1e-5)
    assert tensors[h].shape == (2, 512)
    assert len(model.graph.initializer[0].raw_data or model.graph.initializer[0].float_data) > 0  # model unchanged


def test_analysis_reads_weight_shapes_without_loading_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The channel rules, MACs and parameter count read a weight's shape, not its values: a lazily imported weight
    is loaded by none of them (VGG-11's 530 MB were loaded by each analysis)."""
    b = GraphBuilder({"x": [1, 3, 8, 8]})
    h = b.op("Relu", [b.conv("x", "c1", 3, 16)], "r1")
    flat = b.op("Flatten", [b.op("Relu", [b.conv(h, "c2", 16, 8)], "r2")], "flat")
    out = b.gemm(flat, "fc", 8 * 8 * 8, 1000)  # 2 MB: imported lazily
    loaded = []
    real = gs.ir.tensor.LazyValues.load
    monkeypatch.setattr(gs.ir.tensor.LazyValues, "load", lambda self: loaded.append(self.tensor.name) or real(self))
    graph = gs.import_onnx(infer_shapes(b.model({out: None})))
    assert isinstance(graph.nodes[-1].inputs[1]._values, gs.ir.tensor.LazyValues)
    groups = find_groups(graph)
    assert [g.name for g in groups] == ["c1", "c2", "fc"] and MacModel(graph, groups).total > 0
    assert count_params(graph) == 16 * 3 * 9 + 16 + 8 * 16 * 9 + 8 + 512 * 1000 + 1000
    half = onnx.helper.make_tensor("h", onnx.TensorProto.BFLOAT16, [3], [1, 2, 3])
    bf16 = gs.Constant("h", gs.ir.tensor.LazyValues(half))
    graph.nodes[0].inputs.append(bf16)  # a type numpy has no name for: graph-surgeon gives its ONNX number
    assert count_params(graph) == 16 * 3 * 9 + 16 + 8 * 16 * 9 + 8 + 512 * 1000 + 1000 + 3
    assert not {"c1.w", "c2.w", "fc.w"} & set(loaded)


def test_a_loaded_graphs_copies_share_its_weights() -> None:
    """The compressor reads its graph's weights once: each copy of a lazily imported constant would read them again
    (once per session of a compress)."""
    b = GraphBuilder({"x": [1, 600]})
    graph = gs.import_onnx(b.model({b.gemm("x", "fc", 600, 1000): None}))
    lazy = graph.copy().tensors()["fc.w"]
    assert isinstance(lazy._values, gs.ir.tensor.LazyValues)
    weight = loaded(graph).tensors()["fc.w"].values
    assert graph.copy().tensors()["fc.w"].values is weight and graph.copy().tensors()["fc.b"].values.shape == (1000,)



def test_a_graph_exports_to_the_byte_as_graph_surgeon_exports_it() -> None:
    """``export_model`` copies large constants into the model one at a time (the exporter's one ``extend`` is ~18×
    slower), and writes what ``gs.export_onnx`` writes: every initializer in its order, the lazily imported and
    the array-valued large ones and the small ones; the graph keeps its own constants."""
    b = GraphBuilder({"x": [2, 600]})
    h = b.op("Relu", [b.gemm("x", "fc1", 600, 512)], "relu")  # fc1.w: 1.2 MB, imported lazily
    h = b.op("Relu", [b.gemm(h, "fc2", 512, 512)], "relu2")
    out = b.gemm(h, "fc3", 512, 10)  # fc3.w: small
    graph = gs.import_onnx(b.model({out: None}))
    graph.tensors()["fc2.w"].values  # noqa: B018 - 1 MB, now an array
    assert set(large_constants(graph, EXPORT_BYTES)) == {"fc1.w", "fc2.w"}
    before = [id(t) for n in graph.nodes for t in n.inputs]
    got = export_model(graph)
    assert got.SerializeToString() == gs.export_onnx(graph).SerializeToString()
    assert [t.name for t in got.graph.initializer][:2] == ["fc1.w", "fc1.b"]
    assert [id(t) for n in graph.nodes for t in n.inputs] == before


def test_a_model_is_checked_without_serialising_its_weights(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_model`` hands onnx's checker the graph with its weights as typed inputs (the checker serialises what
    it checks: VGG-11's 530 MB took a second): a valid model with a 1.5 MB weight passes, a node reading an
    undefined tensor still fails, and the checker never sees the weight's bytes."""
    b = GraphBuilder({"x": [1, 384]})
    model = b.model([b.gemm("x", "fc", 384, 1000)])  # fc.w: 1.5 MB
    sizes = []
    real = onnx.checker.C.check_model
    monkeypatch.setattr(onnx.checker.C, "check_model", lambda data, *a: sizes.append(len(data)) or real(data, *a))
    onnx.save(model, tmp_path / "ok.onnx")
    loaded_model = load_model(tmp_path / "ok.onnx")
    assert len(loaded_model.graph.initializer[0].raw_data or loaded_model.graph.initializer[0].float_data) > 0
    assert sizes and max(sizes) < 384 * 1000 * 4
    model.graph.node[0].input[0] = "nowhere"
    onnx.save(model, tmp_path / "bad.onnx")
    with pytest.raises(ModelError, match="bad.onnx: fails onnx.checker"):
        load_model(tmp_path / "bad.onnx")
