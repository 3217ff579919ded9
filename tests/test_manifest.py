"""The kept-channel manifest: a compress result's pruning applied to the user's own torch module gives the pruned
ONNX model's outputs; a module that does not match is refused by layer and left unchanged."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import onnxprune
from models import corpus_recent
from models.mobilenet_v2 import MobileNetV2
from models.resnet import BasicBlock, ResNet
from models.yolo import Detector, two_convs
from onnxprune.errors import OnnxPruneError
from onnxprune.ir.ort import make_session
from onnxprune.strategies import Ratio, Uniform
from onnxprune.torch import apply_manifest, load_manifest, save_manifest
from onnxprune.torch.manifest import module_path
from tests.onnx_builders import export_torch, warm_batchnorms

SHAPE = (1, 3, 64, 64)


def _pruned(module: torch.nn.Module, tmp_path: Path, ratio: float = 0.6) -> tuple[onnxprune.Result, np.ndarray]:
    """``module`` (its norms warmed) exported by torch.onnx and compressed to ``ratio`` on random samples; a test
    batch."""
    torch.manual_seed(0)
    warm_batchnorms(module)
    path = export_torch(module.eval(), tmp_path / "m.onnx", SHAPE)
    rng = np.random.default_rng(0)
    calib = rng.standard_normal((24, *SHAPE[1:])).astype(np.float32)
    result = onnxprune.compress(path, calib, budget=Ratio(ratio), allocate=Uniform())
    return result, rng.standard_normal((3, *SHAPE[1:])).astype(np.float32)


def _onnxruntime(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session, _ = make_session(model, "cpu")
    return session.run(None, {session.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("build", [lambda: MobileNetV2(num_classes=10),
                                   lambda: ResNet(BasicBlock, [3, 4, 6, 3], num_classes=10),
                                   lambda: corpus_recent.ResNeXtLike(), lambda: two_convs(Detector())],
                         ids=["mobilenet_v2", "resnet34", "resnext", "yolov8-style, C2f as two convs"])
def test_the_manifest_applied_to_the_module_gives_the_pruned_models_outputs(tmp_path: Path, build) -> None:
    module = build()
    result, x = _pruned(module, tmp_path)
    entries = result.manifest()
    assert entries and any(e["out_channels"] is not None for e in entries)
    assert all(e["module"] is not None for e in entries)
    user = apply_manifest(copy.deepcopy(module), entries)
    with torch.no_grad():
        got = user(torch.from_numpy(x)).numpy()
    want = _onnxruntime(result.model, x)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert sum(p.numel() for p in user.parameters()) < sum(p.numel() for p in module.parameters())
    kept = next(e for e in entries if e["out_channels"] is not None)
    layer = user.get_submodule(kept["module"])
    assert layer.out_channels == len(kept["out_channels"]) == layer.weight.shape[0]


class Attention(torch.nn.Module):
    """Multi-head self-attention with q, k and v projections apart, or fused in one (timm's ``qkv``), counting its
    heads in ``count`` (``num_heads`` as most code names it)."""

    def __init__(self, dim: int = 32, heads: int = 4, fused: bool = False, count: str = "num_heads") -> None:
        super().__init__()
        self.count, self.head_dim, self.fused = count, dim // heads, fused
        setattr(self, count, heads)
        if fused:
            self.qkv = torch.nn.Linear(dim, 3 * dim)
        else:
            self.q, self.k, self.v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, heads = *x.shape[:2], getattr(self, self.count)
        if self.fused:
            q, k, v = self.qkv(x).reshape(b, n, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = (f(x).reshape(b, n, heads, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = (q @ k.transpose(-2, -1) * self.head_dim ** -0.5).softmax(-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, heads * self.head_dim))


class AttentionNet(torch.nn.Module):
    """Patches, a pre-norm attention block and an MLP (Linears on 3-D tokens: MatMul then Add in the export)."""

    def __init__(self, **attention: object) -> None:
        super().__init__()
        self.embed, self.norm = torch.nn.Conv2d(3, 32, 8, 8), torch.nn.LayerNorm(32)
        self.attn = Attention(**attention)
        self.fc1, self.fc2, self.head = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = self.embed(x).flatten(2).transpose(1, 2)
        t = t + self.attn(self.norm(t))
        return self.head((t + self.fc2(torch.nn.functional.gelu(self.fc1(t)))).mean(1))


@pytest.mark.parametrize("fused", [False, True], ids=["q, k, v apart", "fused qkv"])
def test_an_attention_block_keeps_whole_heads_and_counts_them(tmp_path: Path, fused: bool) -> None:
    """The projections lose whole heads and the block's ``num_heads`` follows; a fused projection's three parts are
    stacked back; the Linears on tokens keep their biases (the export's Adds, and the refit's)."""
    module = AttentionNet(fused=fused)
    result, x = _pruned(module, tmp_path)
    entries = result.manifest()
    heads = [e["heads"] for e in entries if e["heads"]]
    assert heads and all(h[0] == 4 and 0 < h[1] < 4 for h in heads)
    user = apply_manifest(copy.deepcopy(module), entries)
    with torch.no_grad():
        got = user(torch.from_numpy(x)).numpy()
    want = _onnxruntime(result.model, x)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert user.attn.num_heads == heads[0][1] and user.fc1.bias is not None
    assert (user.attn.qkv.out_features if fused else user.attn.q.out_features) == (3 if fused else 1) * 8 * heads[0][1]


def test_an_attention_whose_head_count_has_another_name_is_refused_and_left_unchanged(tmp_path: Path) -> None:
    module = AttentionNet(count="groups_of_channels")
    result, _ = _pruned(module, tmp_path)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(OnnxPruneError, match=r"layer 'attn\.q' keeps \d of 4 heads, but 'attn' has no head count"):
        apply_manifest(module, result.manifest())
    after = module.state_dict()
    assert module.attn.groups_of_channels == 4 and all(torch.equal(before[k], after[k]) for k in before)


def test_a_grouped_and_a_depthwise_conv_keep_their_groups(tmp_path: Path) -> None:
    result, _ = _pruned(MobileNetV2(num_classes=10), tmp_path)
    entries = result.manifest()
    depthwise = next(e for e in entries if e["groups"] > 1)
    user = apply_manifest(MobileNetV2(num_classes=10), entries)
    layer = user.get_submodule(depthwise["module"])
    assert layer.groups == layer.in_channels == layer.out_channels == depthwise["groups"]


def test_a_module_that_does_not_match_is_refused_by_layer_and_left_unchanged(tmp_path: Path) -> None:
    module = MobileNetV2(num_classes=10)
    result, _ = _pruned(module, tmp_path)
    entries = result.manifest()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    renamed = [{**e, "module": e["module"].replace("features.", "layers.")} if i == len(entries) // 2 else e
               for i, e in enumerate(entries)]
    with pytest.raises(OnnxPruneError, match=r"layer 'layers\.\d+.*' .* is not in the module"):
        apply_manifest(module, renamed)
    first = entries[0]["module"]
    parent, _, name = first.rpartition(".")
    wider = copy.deepcopy(module)
    setattr(wider.get_submodule(parent), name, torch.nn.Conv2d(3, 2 * module.get_submodule(first).out_channels, 3))
    with pytest.raises(OnnxPruneError, match=f"layer '{first}': its weight is .* other widths"):
        apply_manifest(wider, entries)
    after = module.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_dynamo_export_names_its_layers_by_their_weights(tmp_path: Path) -> None:
    """torch.onnx's dynamo exporter (the default since torch 2.9) writes no scopes into node names, but names each
    weight after its parameter (``features.0.0.weight``): the manifest reads the layer there, and the module follows."""
    torch.manual_seed(0)
    module = MobileNetV2(num_classes=10)
    warm_batchnorms(module)
    path = tmp_path / "dynamo.onnx"
    torch.onnx.export(module.eval(), (torch.zeros(*SHAPE),), str(path), dynamo=True, verbose=False)
    assert all(module_path(n.name) is None for n in onnx.load(str(path)).graph.node if n.op_type == "Conv")
    rng = np.random.default_rng(0)
    result = onnxprune.compress(str(path), rng.standard_normal((24, *SHAPE[1:])).astype(np.float32),
                                budget=Ratio(0.6), allocate=Uniform())
    entries = result.manifest()
    assert entries and all(e["module"] is not None for e in entries)
    user = apply_manifest(copy.deepcopy(module), entries)
    x = rng.standard_normal(SHAPE).astype(np.float32)  # the export fixed its batch at 1
    with torch.no_grad():
        got = user(torch.from_numpy(x)).numpy()
    want = _onnxruntime(result.model, x)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_a_split_whose_pieces_were_pruned_apart_is_refused_and_a_kept_halving_followed(tmp_path: Path) -> None:
    """A YOLOv8-style C2f cuts its first conv's output in halves (``split((c, c))``): where the pruning narrowed the
    halves apart the module cannot follow and is refused naming the block, unchanged; where they stay equal its
    piece width ``c`` follows."""
    module = Detector()
    result, x = _pruned(module, tmp_path)
    entries = result.manifest()
    splits = {e["module"]: e["pieces"] for e in entries if e["op"] == "Split"}
    apart = next(m for m, (_, after) in splits.items() if len(set(after)) > 1)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(OnnxPruneError, match=rf"layer '{apart}' cuts a tensor in pieces of .* C2f_v2"):
        apply_manifest(module, entries)
    after = module.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    halved = {m for m, (_, after) in splits.items() if len(set(after)) == 1}
    assert halved
    kept_equal = [e for e in entries if e["op"] != "Split" or e["module"] in halved]
    user = apply_manifest(copy.deepcopy(module), kept_equal)
    assert all(user.get_submodule(m).c == splits[m][1][0] for m in halved)


def test_the_manifest_file_round_trips_and_compress_writes_it(tmp_path: Path, tiny) -> None:
    result, _ = _pruned(MobileNetV2(num_classes=10), tmp_path)
    entries = result.manifest()
    save_manifest(entries, tmp_path / "kept.json")
    loaded = load_manifest(tmp_path / "kept.json")
    assert [e["node"] for e in loaded] == [e["node"] for e in entries]
    assert all(np.array_equal(a["weights"][s], b["weights"][s]) for a, b in zip(loaded, entries) for s in a["weights"])
    subprocess.run([sys.executable, "-m", "onnxprune", "compress", str(tiny.path), "-o", str(tmp_path / "t.onnx"),
                    "--calib", str(tiny.calib), "--target-ratio", "0.6", "--manifest", str(tmp_path / "t.json"),
                    "--quiet"], check=True, capture_output=True)
    assert load_manifest(tmp_path / "t.json") and (tmp_path / "t.npz").is_file()
    (tmp_path / "t.npz").unlink()
    with pytest.raises(OnnxPruneError, match="its .npz is missing"):
        load_manifest(tmp_path / "t.json")


@pytest.mark.parametrize(("node", "path"), [("/features/features.3/conv/conv.0/conv.0.0/Conv", "features.3.conv.0.0"),
                                             ("/layer1/layer1.0/downsample/downsample.0/Conv", "layer1.0.downsample.0"),
                                             ("/classifier/classifier.1/Gemm", "classifier.1"), ("/fc/Gemm", "fc"),
                                             ("Conv_12", None), ("/Conv", None)])
def test_a_torchscript_node_name_gives_its_module_path(node: str, path: str | None) -> None:
    assert module_path(node) == path


def test_a_gemm_whose_matrix_is_computed_lists_its_changed_bias_alone() -> None:
    """A Gemm reading a computed B and a constant C: the manifest lists its bias, with no weight and no heads."""
    def model(c: list[float]) -> onnx.ModelProto:
        h = onnx.helper
        graph = h.make_graph(
            [h.make_node("Identity", ["w"], ["b"], name="/fc/Identity"),
             h.make_node("Gemm", ["x", "b", "c"], ["y"], name="/fc/Gemm", transB=1)], "g",
            [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2])],
            [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2])],
            [h.make_tensor("w", onnx.TensorProto.FLOAT, [2, 2], [1, 0, 0, 1]),
             h.make_tensor("c", onnx.TensorProto.FLOAT, [2], c)])
        return h.make_model(graph)

    from onnxprune.torch.manifest import manifest

    [entry] = manifest(model([0.0, 0.0]), model([1.0, 2.0]))
    assert entry["module"] == "fc" and entry["heads"] is None and list(entry["weights"]) == ["bias"]
    assert entry["weights"]["bias"].tolist() == [1.0, 2.0] and entry["original_shapes"] == {"bias": [2]}


def test_a_split_of_equal_pieces_without_sizes_pruned_apart_is_refused() -> None:
    """A Split that names no sizes (``chunk`` in a dynamo or opset-18 export: equal pieces) and whose pruned copy
    cuts pieces 3 and 4: listed, and refused by the block."""
    h = onnx.helper

    def model(sizes: list[int] | None) -> onnx.ModelProto:
        inputs = ["x"] if sizes is None else ["x", "sizes"]
        split = h.make_node("Split", inputs, ["a", "b"], name="/blk/Split", axis=1, num_outputs=2)
        inits = [] if sizes is None else [h.make_tensor("sizes", onnx.TensorProto.INT64, [2], sizes)]
        graph = h.make_graph([split], "g", [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8])],
                             [h.make_tensor_value_info(o, onnx.TensorProto.FLOAT, None) for o in "ab"], inits)
        return h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])

    from onnxprune.torch.manifest import manifest

    [entry] = manifest(model(None), model([3, 4]))
    assert entry["op"] == "Split" and entry["module"] == "blk" and entry["pieces"] == [None, [3, 4]]
    block = torch.nn.Module()
    block.blk = torch.nn.Module()
    with pytest.raises(OnnxPruneError, match=r"layer 'blk' cuts a tensor in equal pieces, the pruned model in pieces "
                                             r"of \[3, 4\]"):
        apply_manifest(block, [entry])


def test_a_split_of_a_block_the_module_lacks_is_refused_by_name(tmp_path: Path) -> None:
    """A Split whose pieces stay equal, of a block the module no longer has (renamed): an OnnxPruneError naming the
    block, not torch's AttributeError."""
    module = Detector()
    result, _ = _pruned(module, tmp_path)
    entries = result.manifest()
    halved = next(e for e in entries if e["op"] == "Split" and len(set(e["pieces"][1])) == 1)
    renamed = [{**halved, "module": "gone." + halved["module"]}]
    with pytest.raises(OnnxPruneError, match=rf"layer 'gone\.{halved['module']}' \(node .*\) is not in the module"):
        apply_manifest(module, renamed)
