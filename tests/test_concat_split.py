"""Channel ranges: Concat, Split and Slice on the channel axis. Every pattern checks that slicing
(one group, then several in turn) equals the original with the dropped channels masked at the
consumers, in onnxruntime; every refusal shows its reason."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from onnxprune.analysis import analyze
from onnxprune.analysis.groups import Group
from onnxprune.passes import slice_channels
from tests.onnx_builders import GraphBuilder, export_graph, run

RNG = np.random.default_rng(3)
X = {"x": RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)}


def masked(graph: gs.Graph, masks: list[tuple[Group, np.ndarray]]) -> onnx.ModelProto:
    """The original graph with each consumer input multiplied, on every range of each group, by that
    group's mask (0 = dropped channel)."""
    g = graph.copy()
    nodes, tensors = {n.name: n for n in g.nodes}, g.tensors()
    factors: dict[tuple[str, str], np.ndarray] = {}
    for group, mask in masks:
        for use in group.consumers:
            axis, repeat = group.tensors[use.tensor]
            f = factors.setdefault((use.node, use.tensor), np.ones(tensors[use.tensor].shape[axis], np.float32))
            for start in group.starts(tensors, use.tensor):
                f[start * repeat : (start + len(mask)) * repeat] *= np.repeat(mask, repeat)
    for k, ((node, name), f) in enumerate(factors.items()):
        src = tensors[name]
        shape = [1] * len(src.shape)
        shape[1] = f.size
        out = gs.Variable(f"{name}.masked{k}", dtype=np.float32, shape=src.shape)
        g.nodes.append(gs.Node("Mul", f"mask{k}", inputs=[src, gs.Constant(f"mask{k}.c", f.reshape(shape))],
                               outputs=[out]))
        nodes[node].inputs = [out if t is src else t for t in nodes[node].inputs]
    return gs.export_onnx(g.cleanup().toposort())


def check(model: onnx.ModelProto, names: list[str], seed: int = 0) -> gs.Graph:
    """Slice the named groups in turn (random channels kept) and compare with the masked original."""
    analysis = analyze(model)
    by_name = {g.name: g for g in analysis.groups}
    rng = np.random.default_rng(seed)
    graph, masks = analysis.graph.copy(), []
    for name in names:
        group = by_name[name]
        assert group.prunable, (name, group.reason)
        keep = np.sort(rng.choice(group.channels, max(1, group.channels // 2), replace=False))
        mask = np.zeros(group.channels, np.float32)
        mask[keep] = 1.0
        masks.append((group, mask))
        graph = slice_channels(graph, group, keep)
    pruned = export_graph(graph)
    for got, want in zip(run(pruned, **X), run(masked(analysis.graph, masks), **X)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return graph


def groups_of(b: GraphBuilder, outputs: list[str]) -> dict[str, list[Group]]:
    out: dict[str, list[Group]] = {}
    for g in analyze(b.model(outputs)).groups:
        out.setdefault(g.producers[0], []).append(g)
    return out


def concat_net() -> tuple[GraphBuilder, str]:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    a = b.op("Relu", [b.conv("x", "a", 3, 8)], "ra")
    c = b.bn(b.conv("x", "b", 3, 6), "bnb", 6)
    cat = b.op("Concat", [a, c], "cat", axis=1)
    return b, b.conv(b.op("Relu", [cat], "rcat"), "head", 14, 4)


def test_concat_inputs_are_ranges_of_the_output() -> None:
    b, out = concat_net()
    groups = groups_of(b, [out])
    (a,), (bb,) = groups["a"], groups["b"]
    assert a.prunable and bb.prunable and [c.node for c in a.consumers] == ["head"]
    assert a.offsets["cat_out"] == [0] and bb.offsets["cat_out"] == [8] and bb.offsets["rcat_out"] == [8]
    assert a.witness == ("a_out", 1, 1)


@pytest.mark.parametrize("order", [["a"], ["b"], ["a", "b"], ["b", "a"]])
def test_concat_slicing_equals_masked_original(order: list[str]) -> None:
    """Pruning ``a`` first shifts ``b``'s range in the concatenation; either order is exact."""
    b, out = concat_net()
    graph = check(b.model([out]), order)
    head = next(n for n in graph.nodes if n.name == "head")
    want = sum({"a": 4, "b": 3}.get(n, c) for n, c in (("a", 8), ("b", 6)) if n in order) + sum(
        c for n, c in (("a", 8), ("b", 6)) if n not in order)
    assert head.inputs[1].shape[1] == want


def test_same_channels_twice_in_a_concat() -> None:
    """A tensor concatenated with itself (or reaching a Concat by two paths): one group, two ranges."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    a = b.op("Relu", [b.conv("x", "a", 3, 8)], "ra")
    m = b.op("Sigmoid", [a], "sig")
    cat = b.op("Concat", [a, b.conv("x", "b", 3, 4), m], "cat", axis=1)
    out = b.conv(cat, "head", 20, 4)
    (g,) = groups_of(b, [out])["a"]
    assert g.offsets["cat_out"] == [0, 12]
    check(b.model([out]), ["a", "b"])
    check(b.model([out]), ["b", "a"], seed=1)


def c2f_net(opset_split_input: bool = True) -> tuple[GraphBuilder, str]:
    """YOLOv8's C2f without shortcut: cv1 → Split in halves → bottleneck on the second half →
    Concat of both halves and the bottleneck's output → cv2."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.op("Relu", [b.conv("x", "cv1", 3, 16, k=1)], "r1")
    if opset_split_input:
        b.op("Split", [y, b.const("sizes", np.array([8, 8]), np.int64)], "split", outputs=2, axis=1)
    else:
        b.op("Split", [y], "split", outputs=2, axis=1)
    p0, p1 = "split_out", "split_out1"
    m = b.op("Relu", [b.conv(b.op("Relu", [b.conv(p1, "m.cv1", 8, 8)], "rm"), "m.cv2", 8, 8)], "rm2")
    cat = b.op("Concat", [p0, p1, m], "cat", axis=1)
    return b, b.conv(cat, "cv2", 24, 6, k=1)


@pytest.mark.parametrize("explicit", [True, False])
def test_split_makes_one_group_per_piece(explicit: bool) -> None:
    b, out = c2f_net(explicit)
    pieces = groups_of(b, [out])["cv1"]
    assert [g.channels for g in pieces] == [8, 8]
    first, second = pieces
    assert [c.node for c in first.consumers] == ["cv2"]
    assert sorted(c.node for c in second.consumers) == ["cv2", "m.cv1"]
    assert first.offsets["r1_out"] == [0] and second.offsets["r1_out"] == [8] and second.offsets["cat_out"] == [8]
    assert first.witness == ("split_out", 1, 1)


@pytest.mark.parametrize("explicit", [True, False])
def test_split_slicing_rewrites_sizes(explicit: bool) -> None:
    b, out = c2f_net(explicit)
    model = b.model([out])
    assert [g.name for g in analyze(model).groups][:2] == ["cv1[0:8]", "cv1[8:16]"]
    graph = check(model, ["cv1[0:8]", "m.cv2"])
    split = next(n for n in graph.nodes if n.op == "Split")
    assert [int(v) for v in split.inputs[1].values] == [4, 8]
    pieces = [g for g in analyze(model).groups if g.producers[0] == "cv1"]
    graph = analyze(model).graph.copy()
    for g in reversed(pieces):  # second piece first, then the first: both sizes follow
        graph = slice_channels(graph, g, np.arange(3))
    split = next(n for n in graph.nodes if n.op == "Split")
    assert [int(v) for v in split.inputs[1].values] == [3, 3]
    assert run(export_graph(graph), **X)[0].shape == (2, 6, 8, 8)


def test_split_pieces_in_turn_equal_masked_original() -> None:
    b, out = c2f_net()
    model = b.model([out])
    analysis = analyze(model)
    first, second = [g for g in analysis.groups if g.producers[0] == "cv1"]
    rng = np.random.default_rng(2)
    graph, masks = analysis.graph.copy(), []
    for g in (second, first):
        keep = np.sort(rng.choice(8, 5, replace=False))
        mask = np.zeros(8, np.float32)
        mask[keep] = 1
        masks.append((g, mask))
        graph = slice_channels(graph, g, keep)
    for got, want in zip(run(export_graph(graph), **X), run(masked(analysis.graph, masks), **X)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_channel_slice_is_a_range() -> None:
    """Slice [4:12) of a conv's 16 channels: the middle range is a group; the dropped ends have no consumer."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.conv("x", "a", 3, 16)
    s = b.op("Slice", [y, b.const("st", np.array([4]), np.int64), b.const("en", np.array([12]), np.int64),
                       b.const("ax", np.array([1]), np.int64)], "slice")
    out = b.conv(s, "head", 8, 4)
    pieces = groups_of(b, [out])["a"]
    assert [g.channels for g in pieces] == [4, 8, 4]
    assert [g.prunable for g in pieces] == [False, True, False]
    assert pieces[0].reason == "no channel-mixing consumer"
    analysis = analyze(b.model([out]))
    middle = next(g for g in analysis.groups if g.name == "a[4:12]")
    graph = analysis.graph.copy()
    graph = slice_channels(graph, middle, np.array([0, 2, 5]))
    sl = next(n for n in graph.nodes if n.op == "Slice")
    assert (int(sl.inputs[1].values[0]), int(sl.inputs[2].values[0])) == (4, 7)
    mask = np.zeros(8, np.float32)
    mask[[0, 2, 5]] = 1
    for got, want in zip(run(export_graph(graph), **X), run(masked(analysis.graph, [(middle, mask)]), **X)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_split_of_a_concat_cuts_the_producers() -> None:
    """A Split whose pieces straddle two concatenated producers cuts them at the piece boundary."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    cat = b.op("Concat", [b.conv("x", "a", 3, 6), b.conv("x", "b", 3, 6)], "cat", axis=1)
    b.op("Split", [cat, b.const("sizes", np.array([4, 8]), np.int64)], "split", outputs=2, axis=1)
    out0, out1 = b.conv("split_out", "h0", 4, 2), b.conv("split_out1", "h1", 8, 2)
    groups = groups_of(b, [out0, out1])
    assert [g.channels for g in groups["a"]] == [4, 2] and [g.channels for g in groups["b"]] == [6]
    analysis = analyze(b.model([out0, out1]))
    names = [g for g in analysis.groups if g.prunable]
    graph = analysis.graph.copy()
    masks = []
    for g in names:
        mask = np.zeros(g.channels, np.float32)
        mask[0] = 1
        masks.append((g, mask))
        graph = slice_channels(graph, g, np.array([0]))
    for got, want in zip(run(export_graph(graph), **X), run(masked(analysis.graph, masks), **X)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- refusals, with reasons


def test_blockers_show_their_reason() -> None:
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.conv("x", "a", 3, 8)
    stepped = b.op("Slice", [y, b.const("st", np.array([0]), np.int64), b.const("en", np.array([8]), np.int64),
                             b.const("ax", np.array([1]), np.int64), b.const("sp", np.array([2]), np.int64)], "step")
    h1 = b.conv(stepped, "h1", 4, 4)
    z = b.conv("x", "c", 3, 8)
    cat = b.op("Concat", [z, "x"], "catx", axis=1)  # a range next to the graph input: fine
    h2 = b.conv(cat, "h2", 11, 4)
    w = b.conv("x", "d", 3, 8)
    out3 = b.op("Concat", [w, b.conv("x", "e", 3, 2)], "catout", axis=1)  # reaches the graph output
    groups = groups_of(b, [h1, h2, out3])
    assert "steps over the channel axis" in groups["a"][0].reason
    assert groups["c"][0].prunable
    assert "graph output catout_out" in groups["d"][0].reason
    assert "graph output catout_out" in groups["e"][0].reason


def test_a_concat_of_flattened_maps_slices_to_the_masked_original() -> None:
    """Each channel of a flattened map is 64 entries of the concatenation; both maps' channels prune (the concat
    blocked them: "concatenates flattened channels")."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    fa = b.op("Flatten", [b.conv("x", "a", 3, 4)], "fa")
    fb = b.op("Flatten", [b.conv("x", "b", 3, 4)], "fb")
    out = b.gemm(b.op("Concat", [fa, fb], "cat", axis=1), "fc", 512, 3)
    check(b.model([out]), ["a", "b"])


def test_a_concat_of_maps_flattened_to_other_widths_is_blocked() -> None:
    """A 4-channel map flattened (64 entries a channel) beside 8 entries of another tensor: the concatenation is not
    made of whole channels of 64, and says so."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8], "y": ["batch", 8]})
    fa = b.op("Flatten", [b.conv("x", "a", 3, 4)], "fa")
    out = b.gemm(b.op("Concat", ["y", fa], "cat", axis=1), "fc", 264, 3)
    assert "with inputs not made of whole ones" in groups_of(b, [out])["a"][0].reason


def test_two_slices_sharing_a_bound_get_constants_of_their_own() -> None:
    """``chunk(2)`` as torch.onnx writes it: the first Slice's end is the second's start, one tensor. Each Slice's
    resized bounds are constants of its own name (they shared one name, which graph-surgeon warned of on stderr at
    every slicing, CSPResNet's stages)."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.conv("x", "a", 3, 16)
    mid, axes = b.const("mid", np.array([8]), np.int64), b.const("ax", np.array([1]), np.int64)
    first = b.op("Slice", [y, b.const("st", np.array([0]), np.int64), mid, axes], "first")
    second = b.op("Slice", [y, mid, b.const("en", np.array([16]), np.int64), axes], "second")
    out = b.conv(b.op("Add", [b.conv(first, "p", 8, 4), b.conv(second, "q", 8, 4)], "sum"), "head", 4, 2)
    graph = check(b.model([out]), ["a[0:8]", "a[8:16]"])
    names = [t.name for t in graph.tensors(check_duplicates=False).values()]
    bounds = [t for n in graph.nodes if n.op == "Slice" for t in n.inputs[1:3]]
    assert len({t.name for t in bounds}) == len({id(t) for t in bounds}) == 4 and len(names) == len(set(names))


def test_range_without_a_tensor_of_its_own_is_blocked() -> None:
    """A conv's channels [8:16) read only as part of the whole output (the Slice reads [0:8)): no tensor
    holds exactly them, so their width after pruning could not be read back — refused, with the reason."""
    b = GraphBuilder({"x": ["batch", 3, 8, 8]})
    y = b.conv("x", "a", 3, 16)
    s = b.op("Slice", [y, b.const("st", np.array([0]), np.int64), b.const("en", np.array([8]), np.int64),
                       b.const("ax", np.array([1]), np.int64)], "slice")
    h1, h2 = b.conv(s, "h1", 8, 2), b.conv(y, "h2", 16, 2)
    first, second = groups_of(b, [h1, h2])["a"]
    assert first.prunable
    assert second.reason == "no tensor holds exactly the 8 channels of a[8:16]"
