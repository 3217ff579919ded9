"""The op registry: one entry teaches the tool a new op everywhere; duplicates are refused; kernels by opset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper

from onnxprune.analysis import analyze
from onnxprune.errors import UnsupportedOpError
from onnxprune.ops import OpEntry, lookup, register, registered
from onnxprune.ops.elementwise import pointwise
from onnxprune.ops.registry import product
from onnxprune.passes import slice_channels
from onnxprune.ops.kernel import OpNode
from onnxprune.torch.engine import TorchGraph
from tests.onnx_builders import GraphBuilder, export_graph, masked_original, run

X = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)


def _shrink(node: OpNode, x: list[torch.Tensor | None]) -> torch.Tensor:
    t, lambd, bias = x[0], node.get("lambd", 0.5), node.get("bias", 0.0)
    return torch.where(t < -lambd, t + bias, torch.where(t > lambd, t - bias, torch.zeros_like(t)))


SHRINK = OpEntry("Shrink", channels=pointwise, macs=lambda node, inp, out: product(out[1:], node),
                 torch={9: _shrink})


def _conv_shrink_conv():
    b = GraphBuilder({"x": [2, 3, 8, 8]})
    y = b.op("Shrink", [b.conv("x", "c1", 3, 6)], "shrink", lambd=0.3, bias=0.1)
    return b.model([b.conv(y, "c2", 6, 4)])


def test_a_new_op_registered_in_one_place_is_known_everywhere() -> None:
    model = _conv_shrink_conv()
    assert lookup("Shrink") is None
    (before,) = [g for g in analyze(model).groups if g.name == "c1"]
    assert before.blockers == ["op Shrink (shrink) is not known to be channel-wise"]
    with pytest.raises(UnsupportedOpError, match="Shrink at node"):
        TorchGraph(model)

    with registered(SHRINK):
        analysis = analyze(model)
        (group,) = [g for g in analysis.prunable if g.name == "c1"]
        shrink = [e for e in analysis.macs.entries if e.node == "shrink"]
        assert [e.macs for e in shrink] == [6 * 8 * 8]
        assert analysis.macs.macs({group.id: 3}) < analysis.macs.total
        keep = np.array([0, 2, 5])
        mask = np.isin(np.arange(6), keep).astype(np.float32)
        want = run(masked_original(analysis.graph, group, mask), x=X)[0]
        pruned = export_graph(slice_channels(analysis.graph.copy(), group, keep))
        got = run(pruned, x=X)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for m, expected in ((model, run(model, x=X)[0]), (pruned, got)):
            out = TorchGraph(m)(torch.from_numpy(X))[0]
            np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-5, atol=1e-6)
    assert lookup("Shrink") is None


def test_a_second_entry_for_an_op_type_is_refused() -> None:
    with registered(SHRINK):
        with pytest.raises(ValueError, match=r"Shrink is already registered \(channels=pointwise, macs=.*torch="):
            register(OpEntry("Shrink"))
        assert lookup("Shrink") is SHRINK


@pytest.mark.parametrize("op, versions", [("Clip", (1, 11)), ("Softmax", (1, 13)), ("TopK", (1, 10)),
                                          ("Reshape", (1, 5)), ("Slice", (1, 10)), ("Pad", (1, 11)),
                                          ("Upsample", (1, 9)), ("Resize", (10, 11))])
def test_the_kernel_is_the_one_of_the_largest_version_up_to_the_opset(op: str, versions: tuple[int, int]) -> None:
    entry = lookup(op)
    old, new = versions
    assert set(entry.torch) == {old, new}
    assert entry.kernel(old) is entry.kernel(new - 1) is entry.torch[old]
    assert entry.kernel(new) is entry.kernel(21) is entry.torch[new]
    assert entry.kernel(old - 1) is None


def test_the_evaluator_runs_the_kernel_of_the_model_opset() -> None:
    """Clip's bounds are attributes before opset 11 and inputs from 11: each model runs its own kernel."""
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)

    def model(opset: int, **attrs):
        inputs = ["x", "lo", "hi"] if opset >= 11 else ["x"]
        inits = [helper.make_tensor("lo", 1, [], [-1.0]), helper.make_tensor("hi", 1, [], [2.0])] if opset >= 11 else []
        node = helper.make_node("Clip", inputs, ["y"], **attrs)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [3, 4])],
                                  [helper.make_tensor_value_info("y", 1, [3, 4])], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)

    for m in (model(6, min=-1.0, max=2.0), model(13)):
        out = TorchGraph(m)(torch.from_numpy(x))[0].numpy()
        np.testing.assert_array_equal(out, run(m, x=x)[0])
        np.testing.assert_array_equal(out, np.clip(x, -1.0, 2.0))
