"""Consumer matrices and unfolding: W·unfold(x) + b must be exactly what onnxruntime computes."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from onnx import TensorProto, helper

from onnxprune.analysis import consumers
from onnxprune.ir.load import import_graph
from onnxprune.imitation.gram import ConsumerStats
from onnxprune.ops.conv import conv_pads, patches
from tests.onnx_builders import run

CASES = {
    "1x1": dict(kernel_shape=[1, 1]),
    "1x1-stride2": dict(kernel_shape=[1, 1], strides=[2, 2]),
    "3x3-pad": dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    "3x3-stride2-asym": dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 1, 1, 0]),
    "3x3-dilated": dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2]),
    "5x3-same-upper": dict(kernel_shape=[5, 3], auto_pad="SAME_UPPER", strides=[2, 1]),
}


def _conv_model(attrs: dict, c: int = 5, o: int = 4, hw: int = 9) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    kh, kw = attrs["kernel_shape"]
    w = helper.make_tensor("w", TensorProto.FLOAT, [o, c, kh, kw], rng.standard_normal(o * c * kh * kw).tolist())
    b = helper.make_tensor("b", TensorProto.FLOAT, [o], rng.standard_normal(o).tolist())
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _im2col(x: np.ndarray, node: gs.Node) -> np.ndarray:
    """Direct patch extraction with loops: rows (B·positions, C·kh·kw), channel-major columns."""
    kh, kw = node.inputs[1].shape[2:]
    sh, sw = node.attrs.get("strides", [1, 1])
    dh, dw = node.attrs.get("dilations", [1, 1])
    top, left, bottom, right = conv_pads(node)
    xp = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    oh = (xp.shape[2] - (kh - 1) * dh - 1) // sh + 1
    ow = (xp.shape[3] - (kw - 1) * dw - 1) // sw + 1
    rows = []
    for n in range(x.shape[0]):
        for i in range(oh):
            for j in range(ow):
                patch = xp[n, :, i * sh : i * sh + (kh - 1) * dh + 1 : dh, j * sw : j * sw + (kw - 1) * dw + 1 : dw]
                rows.append(patch.reshape(-1))
    return np.array(rows)


@pytest.mark.parametrize("name", list(CASES))
def test_conv_unfold_matches_im2col_and_onnxruntime(name: str) -> None:
    model = _conv_model(CASES[name])
    node = next(n for n in import_graph(model).nodes if n.op == "Conv")
    x = np.random.default_rng(1).standard_normal((2, 5, 9, 9)).astype(np.float32)
    cols = consumers.unfold(node, torch.from_numpy(x))  # (B, D, L)
    rows = cols.transpose(1, 2).reshape(-1, cols.shape[1]).numpy()
    np.testing.assert_allclose(rows, _im2col(x, node), atol=1e-6)
    lin = consumers.matrix(node)
    (y,) = run(model, x=x)
    t = (lin.weight @ cols.numpy().astype(np.float64) + lin.bias[:, None]).reshape(y.shape)
    np.testing.assert_allclose(t, y, rtol=1e-4, atol=1e-4)
    # the streamed patch statistics equal the direct computation
    stats = ConsumerStats(lin.weight.shape[1], lin.weight.shape[0])
    stats.update(cols, torch.from_numpy(y.reshape(2, y.shape[1], -1)))
    direct = _im2col(x, node).astype(np.float64)
    np.testing.assert_allclose(stats.xx, direct.T @ direct, rtol=1e-5, atol=1e-4)
    assert lin.k == int(np.prod(CASES[name]["kernel_shape"]))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("stride", "first"), [(1, 0), (4, 1), (7, 6), (50, 3)])
def test_conv_unfold_every_gathers_the_thinned_positions_only(name: str, stride: int, first: int) -> None:
    node = next(n for n in import_graph(_conv_model(CASES[name])).nodes if n.op == "Conv")
    x = torch.from_numpy(np.random.default_rng(2).standard_normal((2, 5, 9, 9)).astype(np.float32))
    assert consumers.positions(node, tuple(x.shape)) == consumers.unfold(node, x).shape[2]
    want = consumers.thin(consumers.unfold(node, x), stride, first)
    assert torch.equal(consumers.unfold_every(node, x, stride, first), want)


def test_grouped_conv_consumer_is_blocked() -> None:
    from onnxprune.analysis.ops import role_of
    from onnxprune.ops.roles import Blocked

    rng = np.random.default_rng(0)
    w = gs.Constant("w", rng.standard_normal((4, 2, 3, 3)).astype(np.float32))
    x, y = gs.Variable("x", np.float32, [1, 4, 8, 8]), gs.Variable("y", np.float32, [1, 4, 8, 8])
    node = gs.Node("Conv", "grouped", attrs={"group": 2, "pads": [1, 1, 1, 1]}, inputs=[x, w], outputs=[y])
    role = role_of(node, ("in", 0), 1, 1)
    assert isinstance(role, Blocked) and "grouped" in role.reason


CT_CASES = {
    "2x2-stride2": dict(kernel_shape=[2, 2], strides=[2, 2]),
    "3x3-stride2-pad-outpad": dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
    "3x3-asym-pad": dict(kernel_shape=[3, 3], pads=[0, 1, 2, 0]),
    "3x2-dilated-stride3": dict(kernel_shape=[3, 2], strides=[3, 2], dilations=[2, 1], pads=[1, 0, 0, 1]),
}


def _conv_transpose_model(attrs: dict, c: int = 5, o: int = 4, hw: int = 6) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    kh, kw = attrs["kernel_shape"]
    w = helper.make_tensor("w", TensorProto.FLOAT, [c, o, kh, kw], rng.standard_normal(o * c * kh * kw).tolist())
    b = helper.make_tensor("b", TensorProto.FLOAT, [o], rng.standard_normal(o).tolist())
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="up", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c, hw, hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("name", list(CT_CASES))
def test_conv_transpose_as_a_matrix_matches_onnxruntime(name: str) -> None:
    """ConvTranspose read as the equivalent stride-1 Conv on the zero-inserted input; written back unchanged."""
    model = _conv_transpose_model(CT_CASES[name])
    graph = import_graph(model)
    node = graph.nodes[0]
    x = np.random.default_rng(1).standard_normal((2, 5, 6, 6)).astype(np.float32)
    (y,) = run(model, x=x)
    lin = consumers.matrix(node)
    cols = consumers.unfold(node, torch.from_numpy(x)).numpy().astype(np.float64)
    assert cols.shape[1] == lin.weight.shape[1] and lin.k == int(np.prod(CT_CASES[name]["kernel_shape"]))
    np.testing.assert_allclose((lin.weight @ cols + lin.bias[:, None]).reshape(y.shape), y, rtol=1e-4, atol=1e-4)
    before = np.asarray(node.inputs[1].values).copy()
    consumers.write(graph, node, lin)
    np.testing.assert_allclose(np.asarray(node.inputs[1].values), before, rtol=1e-6)


@pytest.mark.parametrize("attrs", [dict(kernel_shape=[1]), dict(kernel_shape=[3], pads=[1, 2], strides=[2], dilations=[2])])
def test_conv1d_unfold_matches_onnxruntime(attrs: dict) -> None:
    rng = np.random.default_rng(0)
    k = attrs["kernel_shape"][0]
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 5, k], rng.standard_normal(20 * k).tolist())
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", **attrs)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, 11])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    conv = import_graph(model).nodes[0]
    x = rng.standard_normal((2, 5, 11)).astype(np.float32)
    (y,) = run(model, x=x)
    lin = consumers.matrix(conv)
    cols = consumers.unfold(conv, torch.from_numpy(x)).numpy().astype(np.float64)
    np.testing.assert_allclose((lin.weight @ cols).reshape(y.shape), y, rtol=1e-4, atol=1e-4)
    assert consumers.positions(conv, x.shape) == cols.shape[2]
    assert torch.equal(consumers.unfold_every(conv, torch.from_numpy(x), 3, 2),
                       consumers.thin(consumers.unfold(conv, torch.from_numpy(x)), 3, 2))


@pytest.mark.parametrize("kernel,strides,dilations", [((3, 3), (1, 1), (1, 1)), ((1, 3), (2, 1), (1, 2)),
                                                       ((2, 3), (3, 2), (2, 1)), ((1, 1), (2, 2), (1, 1))])
def test_patches_are_torch_unfold_exactly(kernel, strides, dilations) -> None:
    x = torch.randn(2, 3, 11, 13, generator=torch.Generator().manual_seed(0))
    expected = torch.nn.functional.unfold(x, kernel_size=kernel, dilation=dilations, stride=strides)
    assert torch.equal(patches(x, kernel, strides, dilations), expected)


def test_rows_of_a_block_are_a_view_and_others_a_gather() -> None:
    """A Concat consumer's group reads a run of consecutive unfolded rows: ``rows_of`` gives them without copying the
    input (gigabytes for a 3×3 conv at 320²); scattered rows are gathered. Both equal ``x[:, index]``."""
    x = torch.arange(2 * 10 * 3, dtype=torch.float32).reshape(2, 10, 3)
    block, scattered = np.arange(4, 9), np.array([0, 2, 3, 9])
    for index in (block, scattered):
        torch.testing.assert_close(consumers.rows_of(x, index), x[:, torch.from_numpy(index)], rtol=0, atol=0)
    assert consumers.rows_of(x, block).data_ptr() == x[:, 4].data_ptr()
    assert consumers.rows_of(x, scattered).data_ptr() != x.data_ptr()
