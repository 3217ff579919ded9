"""Attention blocks (issue 71): a fused q/k/v projection split into three (taken apart by Split, Gathers or Slices),
whole heads pruned through the reshapes and the two products of computed tensors (EdgeNeXt's cross-covariance
attention too: q and k normalised by an ``expand_as``), and a linear map reshaped into feature maps pruned by whole
maps.

The oracle is exactness, as in ``test_real_exports``: the heads (maps) a test removes are dead, so the pruned model
must reproduce the original's outputs in onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from models.corpus_recent import _LiteMLA
from onnxprune import api
from onnxprune.analysis import analyze
from onnxprune.ir.graph import const_value
from onnxprune.ir.load import import_graph
from onnxprune.normal.split_qkv import has_fused_qkv
from tests.onnx_builders import compress_dead, export_torch, run, same_outputs

TOKENS, DIM, HEADS = 16, 32, 4


class Attention(nn.Module):
    """timm's multi-head self-attention between two linear maps: one qkv Linear, heads split by a reshape,
    softmax(q·kᵀ/√d)·v, a projection; ``dead`` heads have zero values (their output is zero)."""

    def __init__(self, dead: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.embed, self.qkv, self.proj = nn.Linear(DIM, DIM), nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 10)
        width = DIM // HEADS
        with torch.no_grad():
            for h in dead:
                self.qkv.weight[2 * DIM + h * width:2 * DIM + (h + 1) * width] = 0
                self.qkv.bias[2 * DIM + h * width:2 * DIM + (h + 1) * width] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4)
        attn = (q @ k.transpose(-2, -1) * (c // HEADS) ** -0.5).softmax(-1)
        return self.head(self.proj((attn @ v).transpose(1, 2).reshape(b, n, c)))


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_fused_qkv_splits_into_three_projections_equal_to_the_original(dynamic: bool, tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = export_torch(Attention(), tmp_path / "attn.onnx", (1, TOKENS, DIM), dynamic_batch=dynamic)
    model = onnx.load(str(path))
    assert has_fused_qkv(import_graph(model))
    split = api.load(model)
    assert sum(n.op_type == "MatMul" for n in split.graph.node) == sum(
        n.op_type == "MatMul" for n in model.graph.node) + 2
    assert not has_fused_qkv(import_graph(split))
    x = np.random.default_rng(0).standard_normal((2 if dynamic else 1, TOKENS, DIM)).astype(np.float32)
    np.testing.assert_allclose(run(split, input=x)[0], run(model, input=x)[0], rtol=1e-5, atol=1e-6)


class SeparateAttention(nn.Module):
    """Multi-head attention with q, k and v each their own Linear, split into heads by ``view`` and ``transpose``
    (as DeiT-style and Hugging Face blocks write it); ``dead`` heads have zero values."""

    def __init__(self, dead: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.embed, self.proj, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 10)
        self.q, self.k, self.v = (nn.Linear(DIM, DIM) for _ in range(3))
        width = DIM // HEADS
        with torch.no_grad():
            for h in dead:
                self.v.weight[h * width:(h + 1) * width] = 0
                self.v.bias[h * width:(h + 1) * width] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        b, n, c = x.shape
        q, k, v = (f(x).view(b, n, HEADS, c // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        attn = (q @ k.transpose(-2, -1) * (c // HEADS) ** -0.5).softmax(-1)
        return self.head(self.proj((attn @ v).transpose(1, 2).reshape(b, n, c)))


@pytest.mark.parametrize("block", [Attention, SeparateAttention])
def test_attention_heads_prune_to_the_masked_original(block: type[nn.Module], tmp_path: Path) -> None:
    """q, k and v are one group of 4 heads of 8 entries, the output projection its consumer; with head 2's values
    dead, keeping 3 heads drops it and the pruned model equals the original."""
    torch.manual_seed(0)
    model = api.load(export_torch(block(dead=(2,)), tmp_path / "attn.onnx", (1, TOKENS, DIM)))
    heads = [g for g in analyze(model).groups if g.unit > 1]
    assert [(g.channels, g.unit, g.units, g.prunable, len(g.producers)) for g in heads] == [(HEADS, 8, "heads", True,
                                                                                              3)]
    pruned, report = compress_dead(model, tmp_path, {heads[0].name: 3}, (1, TOKENS, DIM))
    same_outputs(pruned, model, (2, TOKENS, DIM))
    layer = next(x for x in report.layers if x.group == heads[0].name)
    assert (layer.kept, layer.unit, layer.units) == (3, 8, "heads")


class CrossCovariance(Attention):
    """EdgeNeXt's (XCiT's) attention: per head a channels × channels map of q and k, each normalised over the tokens
    (``F.normalize``: divided by an ``expand_as`` of its norms), scaled by a learnt temperature per head, applied to
    v; ``dead`` heads have zero values."""

    def __init__(self, dead: tuple[int, ...] = ()) -> None:
        super().__init__(dead)
        self.temperature = nn.Parameter(torch.rand(HEADS, 1, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, HEADS, c // HEADS).permute(2, 0, 3, 4, 1)
        attn = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * self.temperature
        return self.head(self.proj((attn.softmax(-1) @ v).permute(0, 3, 1, 2).reshape(b, n, c)))


@pytest.mark.parametrize("dynamic", [True, False])
def test_cross_covariance_heads_prune_through_the_expand_of_their_norms(dynamic: bool, tmp_path: Path) -> None:
    """The norms are expanded to ``Shape(q)`` (dynamic batch) or to a constant target that holds the head count
    (static): either way the 4 heads are one group and keeping 3 drops the dead one exactly."""
    torch.manual_seed(0)
    model = api.load(export_torch(CrossCovariance(dead=(2,)), tmp_path / "xca.onnx", (1, TOKENS, DIM),
                                  dynamic_batch=dynamic))
    graph = import_graph(model)
    targets = [n.inputs[1] for n in graph.nodes if n.op == "Expand"]
    assert len(targets) == 2 and all((const_value(t) is None) == dynamic for t in targets)
    heads = [g for g in analyze(model).groups if g.unit > 1]
    assert [(g.channels, g.unit, g.prunable, len(g.producers)) for g in heads] == [(HEADS, 8, True, 3)]
    pruned, _ = compress_dead(model, tmp_path, {heads[0].name: 3}, (1, TOKENS, DIM))
    same_outputs(pruned, model, (2 if dynamic else 1, TOKENS, DIM))


def test_q_k_v_taken_apart_by_slices_split_into_three_projections(tmp_path: Path) -> None:
    """``torch.export`` writes ``unbind(0)`` as three one-index Slices, each squeezed, after a Reshape with
    ``allowzero``: split like the others, the same outputs."""
    rng = np.random.default_rng(0)
    width = DIM // HEADS
    const = {"w": rng.standard_normal((DIM, 3 * DIM)), "b": rng.standard_normal(3 * DIM),
             "target": np.array([1, TOKENS, 3, HEADS, width]), "merged": np.array([1, TOKENS, DIM]),
             "axis0": np.array([0]), "p": rng.standard_normal((DIM, DIM))}
    const.update({f"s{i}": np.array([i]) for i in range(4)})
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Add", ["y", "b"], ["yb"]),
             helper.make_node("Reshape", ["yb", "target"], ["r"], allowzero=1),
             helper.make_node("Transpose", ["r"], ["t"], perm=[2, 0, 3, 1, 4])]
    for i, name in enumerate("qkv"):
        nodes += [helper.make_node("Slice", ["t", f"s{i}", f"s{i + 1}", "axis0"], [f"{name}1"]),
                  helper.make_node("Squeeze", [f"{name}1", "axis0"], [name])]
    nodes += [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Softmax", ["s"], ["a"], axis=-1),
              helper.make_node("MatMul", ["a", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "merged"], ["m"]), helper.make_node("MatMul", ["m", "p"], ["out"])]
    inits = [helper.make_tensor(k, TensorProto.INT64 if v.dtype.kind == "i" else TensorProto.FLOAT, v.shape,
                                v.reshape(-1).tolist()) for k, v in const.items()]
    graph = helper.make_graph(nodes, "unbind_by_slices",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, DIM])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, TOKENS, DIM])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model)
    assert has_fused_qkv(import_graph(model))
    split = api.load(model)
    assert not has_fused_qkv(import_graph(split))
    assert [g.units for g in analyze(split).groups if g.unit > 1] == ["heads"]
    x = rng.standard_normal((1, TOKENS, DIM)).astype(np.float32)
    np.testing.assert_allclose(run(split, x=x)[0], run(model, x=x)[0], rtol=1e-5, atol=1e-5)


class TalkingHeads(nn.Module):
    """EfficientFormerV2's attention on a 4×4 map in miniature: 1×1 q/k/v convs reshaped into 4 heads as
    ``[B, heads, d, H·W]`` (the channels split, the positions merged in one reshape), a bias per head and offset,
    1×1 convs across the heads before and after the softmax, a depthwise "local value" added to the output. q and
    k of head 1 are dead and unread by the first talking-heads conv; v, its local value and the projection's columns
    of head 2 are dead."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.q, self.k = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 16, 1), nn.Conv2d(8, 16, 1)
        self.v, self.local = nn.Conv2d(8, 32, 1), nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.talk1, self.talk2, self.proj = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(32, 8, 1)
        self.bias = nn.Parameter(torch.randn(4, 16, 16))
        with torch.no_grad():
            for conv in (self.q, self.k):
                conv.weight[4:8], conv.bias[4:8] = 0, 0
            self.talk1.weight[:, 1] = 0
            for conv in (self.v, self.local):
                conv.weight[16:24], conv.bias[16:24] = 0, 0
            self.proj.weight[:, 16:24] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        b = x.shape[0]
        q = self.q(x).reshape(b, 4, -1, 16).permute(0, 1, 3, 2)
        k = self.k(x).reshape(b, 4, -1, 16)
        v = self.v(x)
        local = self.local(v)
        attn = self.talk2(self.talk1(q @ k * 0.5 + self.bias).softmax(-1))
        out = (attn @ v.reshape(b, 4, -1, 16).permute(0, 1, 3, 2)).transpose(2, 3).reshape(b, 32, 4, 4)
        return self.proj(out + local)


@pytest.mark.parametrize("dynamic", [True, False])
def test_heads_split_from_the_channels_while_positions_merge_prune_to_the_masked_original(dynamic: bool,
                                                                                      tmp_path: Path) -> None:
    """``[B, 16, 4, 4]`` -> ``[B, 4, 4, 16]`` splits the channels into heads and merges the positions at once: q and k
    are one group of 4 heads (the first talking-heads conv its consumer), v and the second talking-heads conv
    another (the projection its consumer); keeping 3 heads of each drops the dead ones exactly."""
    torch.manual_seed(0)
    model = api.load(export_torch(TalkingHeads(), tmp_path / "talk.onnx", (1, 3, 4, 4), dynamic_batch=dynamic))
    heads = {g.name.split("/")[1]: g for g in analyze(model).groups if g.unit > 1}
    assert {k: (g.channels, g.unit, g.prunable, len(g.producers)) for k, g in heads.items()} == {
        "q": (4, 4, True, 2), "v": (4, 8, True, 2)}
    pruned, _ = compress_dead(model, tmp_path, {heads["q"].name: 3, heads["v"].name: 3}, (1, 3, 4, 4))
    same_outputs(pruned, model, (2 if dynamic else 1, 3, 4, 4))


class LinearAttention(nn.Module):
    """EfficientViT's LiteMLA (``models.corpus_recent._LiteMLA``) on 32 channels: 2 heads of q, k and v of 16 each
    from one 1×1 conv, a multi-scale copy through a depthwise 5×5 and a 1×1 grouped by q/k/v of each head, both
    concatenated and reshaped into 4 heads of 48 entries, ReLU linear attention, a projection; head 1's values dead
    (zero in the copy too)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.attention = nn.Conv2d(3, 32, 1), _LiteMLA(32).eval()
        with torch.no_grad():
            self.attention.qkv.weight[48 + 32:48 + 48] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(self.embed(x))


@pytest.mark.parametrize("dynamic", [True, False])
def test_heads_of_conv_groups_through_a_concat_prune_to_the_masked_original(dynamic: bool, tmp_path: Path) -> None:
    """A head is three conv groups of the grouped 1×1 (its q, k and v) and sits twice in the concatenation (the conv's
    output and its multi-scale copy): one group of 2 heads of 48 entries; keeping 1 drops the dead one in both."""
    torch.manual_seed(0)
    model = api.load(export_torch(LinearAttention(), tmp_path / "mla.onnx", (1, 3, 8, 8), dynamic_batch=dynamic))
    (heads,) = [g for g in analyze(model).groups if g.unit > 1]
    assert (heads.channels, heads.unit, heads.units, heads.prunable) == (2, 48, "heads", True)
    pruned, _ = compress_dead(model, tmp_path, {heads.name: 1}, (1, 3, 8, 8))
    same_outputs(pruned, model, (2 if dynamic else 1, 3, 8, 8))


def test_the_width_a_product_sums_over_is_not_pruned_and_says_why(tmp_path: Path) -> None:
    """Without the heads' reshape (one head), q·kᵀ sums over the projections' channels: q's and k's group is
    blocked by that product, in words; v's channels run through attn·v to the projection and prune."""

    class OneHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.proj = (nn.Linear(DIM, DIM) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            attn = (self.q(x) @ self.k(x).transpose(-2, -1)).softmax(-1)
            return self.proj(attn @ self.v(x))

    torch.manual_seed(0)
    model = api.load(export_torch(OneHead(), tmp_path / "one.onnx", (1, TOKENS, DIM)))
    reasons = {g.name.split("/")[1]: g.reason for g in analyze(model).groups}
    assert "a product of two computed tensors sums over these channels" in reasons["q"]
    assert "a product of two computed tensors sums over these channels" in reasons["k"]
    assert reasons["v"] is None


class MapDecoder(nn.Module):
    """A linear map reshaped into 8 feature maps of 4x4, then a 1x1 conv: the maps are the conv's input channels."""

    def __init__(self, dead: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.fc, self.conv = nn.Linear(16, 8 * 16), nn.Conv2d(8, 4, 1)
        with torch.no_grad():
            for c in dead:
                self.fc.weight[c * 16:(c + 1) * 16] = 0
                self.fc.bias[c * 16:(c + 1) * 16] = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.relu(self.fc(x)).reshape(-1, 8, 4, 4))


def test_a_linear_map_reshaped_into_feature_maps_prunes_whole_maps(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = api.load(export_torch(MapDecoder(dead=(1, 6)), tmp_path / "dec.onnx", (1, 16)))
    (group,) = [g for g in analyze(model).groups if g.prunable]
    assert (group.channels, group.unit) == (8, 16)
    pruned, _ = compress_dead(model, tmp_path, {group.name: 6}, (1, 16))
    same_outputs(pruned, model, (3, 16))
