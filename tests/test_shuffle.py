"""ShuffleNetV2's channel shuffle (issue 71): ``normal.unshuffle`` moves the permutation into the weights that read it,
so a unit's channels are ranges of its branches' outputs, which prune.

The oracle is exactness: the rewritten graph computes what the export did, and the channels a test removes are dead
(their conv rows and BatchNorm zeroed), so the pruned model must reproduce the original's outputs in onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from models._layers import conv_norm_act
from models.corpus import _ShuffleUnit
from onnxprune import api
from onnxprune.analysis import analyze
from onnxprune.ir.load import inferred_graph
from onnxprune.normal.unshuffle import has_channel_permutation, unshuffle
from tests.onnx_builders import compress_dead, export_torch, run, same_outputs, warm_batchnorms

HALF = 8  # channels of a unit's branch: the units carry 2 × HALF


class ShuffleTiny(nn.Module):
    """A stem, a strided ShuffleNetV2 unit, a unit with the channel split, a 1×1 conv and a classifier; ``dead``
    zeroes channels of the strided unit's main branch (its last conv + BatchNorm)."""

    def __init__(self, dead: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.stem = conv_norm_act(3, 12)
        self.down, self.unit = _ShuffleUnit(12, 2 * HALF, 2), _ShuffleUnit(2 * HALF, 2 * HALF, 1)
        self.head, self.fc = conv_norm_act(2 * HALF, 24, 1), nn.Linear(24, 10)
        warm_batchnorms(self)
        last = self.down.main[2]
        with torch.no_grad():
            for module in (last[0], last[1]):
                module.weight[list(dead)] = 0
            last[1].bias[list(dead)] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.head(self.unit(self.down(self.stem(x)))).mean((2, 3)))


def _export(tmp_path: Path, dead: tuple[int, ...] = ()) -> onnx.ModelProto:
    torch.manual_seed(0)
    return onnx.load(str(export_torch(ShuffleTiny(dead).eval(), tmp_path / "shuffle.onnx", (1, 3, 16, 16))))


def test_the_shuffle_moved_into_the_weights_computes_what_the_export_did(tmp_path: Path) -> None:
    model = _export(tmp_path)
    assert has_channel_permutation(inferred_graph(model))
    loaded = api.load(model)
    ops = {n.op_type for n in loaded.graph.node}
    assert "Transpose" not in ops and "Gather" not in ops, ops
    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)
    np.testing.assert_allclose(run(loaded, input=x)[0], run(model, input=x)[0], rtol=1e-5, atol=1e-6)


def test_a_branchs_channels_that_the_shuffle_interleaves_prune_to_the_masked_original(tmp_path: Path) -> None:
    """The strided unit's main branch (8 channels) lands on the odd channels; the next unit's split sends its first 4
    on through the identity half and its last 4 into the branch: two groups of 4, one dead channel each."""
    model = api.load(_export(tmp_path, dead=(1, 5)))
    pieces = {g.piece: g for g in analyze(model).groups if "down/main/main.2" in g.name}
    assert set(pieces) == {"[0:4]", "[4:8]"} and all(g.prunable for g in pieces.values()), \
        {p: g.reason for p, g in pieces.items()}
    pruned, _ = compress_dead(model, tmp_path, {g.name: 3 for g in pieces.values()}, (1, 3, 16, 16), fixed=True,
                              residual_streams=True)
    same_outputs(pruned, model, (2, 3, 16, 16))


def _gather_model(index: list[int], reader: str) -> onnx.ModelProto:
    """x → Conv(4→6) → Gather(axis 1, ``index``) → ``reader`` (a BatchNormalization then a 1×1 Conv, or a Conv
    alone, or the graph output) → y."""
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((6, 4, 1, 1)).astype(np.float32), "w1"),
             numpy_helper.from_array(np.array(index, np.int64), "index"),
             numpy_helper.from_array(rng.standard_normal((5, 6, 1, 1)).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1"),
             helper.make_node("Gather", ["a", "index"], ["b" if reader != "output" else "y"], axis=1, name="gather")]
    if reader == "bn":
        for name, values in (("scale", rng.uniform(0.5, 2, 6)), ("shift", rng.standard_normal(6)),
                             ("mean", rng.standard_normal(6)), ("var", rng.uniform(0.5, 2, 6))):
            inits.append(numpy_helper.from_array(values.astype(np.float32), name))
        nodes.append(helper.make_node("BatchNormalization", ["b", "scale", "shift", "mean", "var"], ["c"], name="bn"))
    if reader != "output":
        nodes.append(helper.make_node("Conv", ["c" if reader == "bn" else "b", "w2"], ["y"], name="conv2"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("reader", ["bn", "conv", "output"])
def test_a_channel_permutation_ends_in_the_weights_or_stays_before_an_output(reader: str) -> None:
    model = _gather_model([3, 0, 5, 1, 4, 2], reader)
    graph = unshuffle(inferred_graph(model))
    gathers = [n for n in graph.nodes if n.op == "Gather"]
    assert len(gathers) == (1 if reader == "output" else 0), [n.name for n in graph.nodes]
    out = gs.export_onnx(graph)
    x = np.random.default_rng(2).standard_normal((1, 4, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(run(out, x=x)[0], run(model, x=x)[0], rtol=1e-5, atol=1e-5)


def test_a_selection_of_channels_is_not_a_permutation() -> None:
    """A Gather that drops or repeats channels is no shuffle: nothing to do."""
    assert not has_channel_permutation(inferred_graph(_gather_model([3, 0, 5, 1], "conv")))
    assert not has_channel_permutation(inferred_graph(_gather_model([3, 0, 5, 1, 4, 3], "conv")))


class ShuffledOutput(nn.Module):
    """A conv whose output, shuffled, is the graph's output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        n, c, h, w = y.shape
        return y.view(n, 2, c // 2, h, w).transpose(1, 2).reshape(n, c, h, w)


def test_a_shuffle_written_to_a_graph_output_stays_one_gather(tmp_path: Path) -> None:
    """The output keeps its channel order, so the permutation is not moved past the node that writes it (it was,
    once per round, leaving a chain of Identity nodes)."""
    torch.manual_seed(0)
    model = onnx.load(str(export_torch(ShuffledOutput().eval(), tmp_path / "out.onnx", (1, 3, 4, 4))))
    loaded = api.load(model)
    assert [n.op_type for n in loaded.graph.node] == ["Conv", "Gather", "Identity"]
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(run(loaded, input=x)[0], run(model, input=x)[0])
