"""Passes: slice_channels + scale_columns equal the original with masked/re-weighted consumer columns;
refit_consumer writes weights that onnxruntime reproduces."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onnxprune.analysis import analyze, consumers
from onnxprune.analysis.groups import Group
from onnxprune.passes import refit_consumer, scale_columns, slice_channels
from tests.onnx_builders import GraphBuilder, export_graph, masked_original, run

RNG = np.random.default_rng(0)


def conv_bn_dw_conv() -> tuple[GraphBuilder, str]:
    """conv → BN → relu → depthwise conv → relu → conv (3x3 consumer)."""
    b = GraphBuilder({"x": ["batch", 3, 10, 10]})
    y = b.op("Relu", [b.bn(b.conv("x", "c1", 3, 12, bias=False), "bn", 12)], "r1")
    y = b.op("Relu", [b.conv(y, "dw", 12, 12, group=12, stride=2)], "r2")
    return b, b.conv(y, "c2", 12, 5)


def conv_gap_gemm() -> tuple[GraphBuilder, str]:
    """conv → relu → GlobalAveragePool → Flatten → Gemm."""
    b = GraphBuilder({"x": ["batch", 3, 10, 10]})
    y = b.op("Relu", [b.conv("x", "c1", 3, 9)], "r1")
    y = b.op("Flatten", [b.op("GlobalAveragePool", [y], "gap")], "flat")
    return b, b.gemm(y, "fc", 9, 4)


def conv_flatten_gemm() -> tuple[GraphBuilder, str]:
    """conv → relu → Flatten → Gemm (transB=0): each channel owns 5x5 = 25 consecutive columns."""
    b = GraphBuilder({"x": ["batch", 3, 10, 10]})
    y = b.op("Relu", [b.conv("x", "c1", 3, 7, stride=2)], "r1")
    return b, b.gemm(b.op("Flatten", [y], "flat"), "fc", 7 * 25, 4, trans_b=0, alpha=0.5, beta=2.0)


def matmul_chain() -> tuple[GraphBuilder, str]:
    """x (B, T, 6) → MatMul → +bias → relu → MatMul → relu → MatMul."""
    b = GraphBuilder({"x": ["batch", 4, 6]})
    h = b.op("Relu", [b.op("Add", [b.matmul("x", "m1", 6, 10), b.rand("m1.b", (10,))], "m1_add")], "r1")
    h = b.op("Relu", [b.matmul(h, "m2", 10, 8)], "r2")
    return b, b.matmul(h, "m3", 8, 3)


def gemm_chain() -> tuple[GraphBuilder, str]:
    """Gemm (transB=0, alpha/beta) → relu → Gemm (transB=1)."""
    b = GraphBuilder({"x": ["batch", 6]})
    h = b.op("Relu", [b.gemm("x", "g1", 6, 11, trans_b=0, alpha=1.5, beta=0.5)], "r1")
    return b, b.gemm(h, "g2", 11, 3)


def _feeds(graph: gs.Graph, batch: int = 3) -> dict[str, np.ndarray]:
    feeds = {}
    for t in graph.inputs:
        shape = [batch if not isinstance(d, int) else d for d in t.shape]
        feeds[t.name] = RNG.standard_normal(shape).astype(np.float32)
    return feeds


CASES = {
    "conv_bn_dw_conv": (conv_bn_dw_conv, "c1"),
    "conv_gap_gemm": (conv_gap_gemm, "c1"),
    "conv_flatten_gemm": (conv_flatten_gemm, "c1"),
    "matmul_chain/m1": (matmul_chain, "m1"),
    "matmul_chain/m2": (matmul_chain, "m2"),
    "gemm_chain": (gemm_chain, "g1"),
}


def _case(name: str) -> tuple[gs.Graph, Group, dict[str, np.ndarray]]:
    build, group_name = CASES[name]
    b, out = build()
    analysis = analyze(b.model([out]))
    group = next(g for g in analysis.groups if g.name == group_name)
    assert group.prunable, group.reason
    return analysis.graph, group, _feeds(analysis.graph)


PREPARED = {name: _case(name) for name in CASES}


def test_case_groups() -> None:
    repeats = {name: sorted({c.repeat for c in g.consumers}) for name, (_, g, _) in PREPARED.items()}
    assert repeats["conv_flatten_gemm"] == [25]
    assert repeats["conv_gap_gemm"] == [1]
    assert "dw_out" in PREPARED["conv_bn_dw_conv"][1].tensors


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(w).max())))


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_slice_and_scale_equals_masked_original(name: str, data: st.DataObject) -> None:
    graph, group, feeds = PREPARED[name]
    n = group.channels
    keep = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n))))
    scale = np.array(data.draw(st.lists(st.floats(-2.0, 2.0, allow_nan=False, width=32),
                                        min_size=len(keep), max_size=len(keep))))
    mask = np.zeros(n)
    mask[keep] = scale
    want = run(masked_original(graph, group, mask), **feeds)
    pruned = scale_columns(slice_channels(graph.copy(), group, keep), group, scale)
    _assert_close(run(export_graph(pruned), **feeds), want)


@pytest.mark.parametrize("name", list(CASES))
def test_keep_all_with_unit_scale_is_exact(name: str) -> None:
    graph, group, feeds = PREPARED[name]
    want = run(export_graph(graph.copy()), **feeds)
    keep = np.arange(group.channels)
    pruned = scale_columns(slice_channels(graph.copy(), group, keep), group, np.ones(group.channels))
    for got, ref in zip(run(export_graph(pruned), **feeds), want):
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", list(CASES))
def test_slice_order_of_keep_does_not_matter(name: str) -> None:
    """``keep`` is a set: an unsorted keep array slices the same channels in the same order."""
    graph, group, feeds = PREPARED[name]
    keep = RNG.choice(group.channels, max(1, group.channels // 2), replace=False)
    a = run(export_graph(slice_channels(graph.copy(), group, keep)), **feeds)
    b = run(export_graph(slice_channels(graph.copy(), group, np.sort(keep))), **feeds)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_shared_initializer_is_not_sliced_for_other_nodes() -> None:
    """Exporters deduplicate equal weights: slicing one user of a shared constant leaves the others intact."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    w = b.rand("shared.w", (6, 3, 3, 3))
    y1 = b.op("Relu", [b.op("Conv", ["x", w], "c1", pads=[1, 1, 1, 1])], "r1")
    out1 = b.conv(y1, "c2", 6, 4)
    out2 = b.op("Conv", ["x", w], "c3", pads=[1, 1, 1, 1])
    analysis = analyze(b.model([out1, out2]))
    group = next(g for g in analysis.groups if g.name == "c1")
    feeds = _feeds(analysis.graph)
    want = run(export_graph(analysis.graph.copy()), **feeds)
    keep = np.array([0, 2, 5])
    pruned = scale_columns(slice_channels(analysis.graph.copy(), group, keep), group, np.full(3, 2.0))
    got = run(export_graph(pruned), **feeds)
    np.testing.assert_array_equal(got[1], want[1])
    mask = np.zeros(6)
    mask[keep] = 2.0
    _assert_close(got[:1], run(masked_original(analysis.graph, group, mask), **feeds)[:1])


# ---------------------------------------------------------------- refit_consumer


def _single_consumer(op_builder) -> tuple[gs.Graph, gs.Node, dict[str, np.ndarray]]:
    b, out = op_builder()
    graph = analyze(b.model([out])).graph
    node = next(n for n in graph.nodes if n.op in ("Conv", "Gemm", "MatMul"))
    return graph, node, _feeds(graph)


def _conv(bias: bool):
    def build():
        b = GraphBuilder({"x": ["batch", 4, 9, 9]})
        return b, b.conv("x", "c", 4, 6, 3, stride=2, pad=1, bias=bias)
    return build


def _gemm(trans_b: int, bias: bool):
    def build():
        b = GraphBuilder({"x": ["batch", 7]})
        return b, b.gemm("x", "g", 7, 5, trans_b=trans_b, bias=bias, alpha=0.5, beta=3.0)
    return build


def _matmul():
    b = GraphBuilder({"x": ["batch", 3, 7]})
    return b, b.op("Relu", [b.matmul("x", "m", 7, 5)], "r")


@pytest.mark.parametrize("builder,zero_bias", [
    (_conv(True), False), (_conv(False), False), (_gemm(0, True), False), (_gemm(1, False), False),
    (_matmul, False), (_matmul, True),
], ids=["conv", "conv-nobias", "gemm", "gemm-transB-nobias", "matmul", "matmul-zero-bias"])
def test_refit_consumer_written_weights_run_in_onnxruntime(builder, zero_bias: bool) -> None:
    graph, node, feeds = _single_consumer(builder)
    old = consumers.matrix(node)
    w = RNG.standard_normal(old.weight.shape)
    bias = np.zeros(len(old.bias)) if zero_bias else RNG.standard_normal(len(old.bias))
    n_nodes = len(graph.nodes)
    graph = refit_consumer(graph, node.name, consumers.Linear(w, bias, old.k))
    new_node = next(n for n in graph.nodes if n.name == node.name)
    again = consumers.matrix(new_node)
    np.testing.assert_allclose(again.weight, w, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(again.bias, bias, rtol=1e-6, atol=1e-6)

    (got,) = run(export_graph(graph), **feeds)
    x = feeds["x"].astype(np.float64)
    if node.op == "Conv":
        k = tuple(new_node.inputs[1].shape[2:])
        want = F.conv2d(torch.from_numpy(x), torch.from_numpy(w.reshape(len(w), -1, *k)), torch.from_numpy(bias),
                        stride=2, padding=1).numpy()
    else:
        want = x @ w.T + bias
        if node.op == "MatMul":
            want = np.maximum(want, 0.0)
            assert len(graph.nodes) == n_nodes + (0 if zero_bias else 1)  # a bias Add only when needed
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _conv_chain_without_bias() -> tuple[GraphBuilder, str]:
    """conv → BN → relu → conv → BN → relu → conv, the first two convs without a bias input."""
    b = GraphBuilder({"x": ["batch", 3, 10, 10]})
    y = b.op("Relu", [b.bn(b.conv("x", "c1", 3, 12, bias=False), "bn1", 12)], "r1")
    y = b.op("Relu", [b.bn(b.conv(y, "c2", 12, 10, bias=False), "bn2", 10)], "r2")
    return b, b.conv(y, "c3", 10, 4)


def _matmul_chain_without_bias() -> tuple[GraphBuilder, str]:
    b = GraphBuilder({"x": ["batch", 4, 6]})
    h = b.op("Relu", [b.matmul("x", "m1", 6, 10)], "r1")
    h = b.op("Relu", [b.matmul(h, "m2", 10, 8)], "r2")
    return b, b.matmul(h, "m3", 8, 3)


@pytest.mark.parametrize("builder,first,second", [
    (_conv_chain_without_bias, "c1", "c2"), (_matmul_chain_without_bias, "m1", "m2"),
], ids=["conv", "matmul"])
def test_refit_bias_is_sliced_when_the_node_is_pruned_as_producer(builder, first: str, second: str) -> None:
    """The pipeline prunes group 1 (refitting its consumer, which gains a bias), then group 2 produced by
    that consumer: the new bias must be sliced with the consumer's output channels."""
    b, out = builder()
    analysis = analyze(b.model([out]))
    groups = {g.name: g for g in analysis.groups}
    g1, g2 = groups[first], groups[second]
    (use,) = g1.consumers
    assert use.node == second
    graph = slice_channels(analysis.graph.copy(), g1, np.array([0, 3, 4, 8]))
    node = next(n for n in graph.nodes if n.name == second)
    lin = consumers.matrix(node)
    graph = refit_consumer(graph, second, consumers.Linear(RNG.standard_normal(lin.weight.shape),
                                                           RNG.standard_normal(len(lin.bias)), lin.k))
    feeds = _feeds(graph)
    keep = np.array([1, 2, 5])
    mask = np.zeros(g2.channels)
    mask[keep] = 1.0
    want = run(masked_original(graph, g2, mask), **feeds)
    _assert_close(run(export_graph(slice_channels(graph.copy(), g2, keep)), **feeds), want)


def test_refit_matmul_twice_keeps_one_bias() -> None:
    graph, node, feeds = _single_consumer(_matmul)
    old = consumers.matrix(node)
    for _ in range(2):
        w, bias = RNG.standard_normal(old.weight.shape), RNG.standard_normal(len(old.bias))
        graph = refit_consumer(graph, node.name, consumers.Linear(w, bias, 1))
    assert [n.op for n in graph.nodes].count("Add") == 1
    again = consumers.matrix(next(n for n in graph.nodes if n.name == node.name))
    np.testing.assert_allclose(again.bias, bias, rtol=1e-6)
    (got,) = run(export_graph(graph), **feeds)
    np.testing.assert_allclose(got, np.maximum(feeds["x"] @ w.T + bias, 0.0), rtol=1e-4, atol=1e-4)
