"""``to_torch`` / ``from_torch``: corpus architectures exported by torch.onnx run in torch as onnxruntime runs them,
and a module trained a step is written back into the same graph, checked by onnxruntime."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import onnxprune
from models import corpus, corpus_former, corpus_recent
from onnxprune.errors import ModelError, OnnxPruneError
from onnxprune.ir.ort import make_session

# builder, input shape, opset, dynamic batch: a classifier of each family the corpus holds, a segmenter, a detector
# head and a recurrent text recogniser (``benchmarks/corpus_torch.py`` exports the same at the same sizes)
EXPORTS = {
    "unet (segmenter)": (corpus.SkipSizedUNet, (1, 3, 128, 128), 17, True),
    "nms-free detector head": (corpus.NmsFreeDetector, (1, 3, 320, 320), 17, False),
    "convnext (LayerNorm, depthwise)": (corpus.ConvNeXtLike, (1, 3, 224, 224), 17, True),
    "shufflenet (grouped, shuffle)": (corpus.ShuffleNetLike, (1, 3, 224, 224), 13, False),
    "ghostnet": (corpus.GhostNetLike, (1, 3, 224, 224), 13, False),
    "densenet": (corpus.DenseNetLike, (1, 3, 224, 224), 15, True),
    "regnet (grouped)": (corpus.RegNetLike, (1, 3, 224, 224), 12, False),
    "mobilevit (attention)": (corpus.MobileViTLike, (1, 3, 256, 256), 13, True),
    "resnext (grouped)": (corpus_recent.ResNeXtLike, (1, 3, 224, 224), 13, True),
    "efficientvit (heads)": (corpus_recent.EfficientViTLike, (1, 3, 224, 224), 17, False),
    "edgenext (xca heads, LayerNorm)": (corpus_recent.EdgeNeXtLike, (1, 3, 256, 256), 17, False),
    "fastvit (mobileone)": (corpus_recent.FastViTLike, (1, 3, 256, 256), 17, False),
    "efficientformerv2 (talking heads)": (corpus_former.EfficientFormerV2Like, (1, 3, 224, 224), 17, False),
    "crnn (lstm)": (corpus.CRNN, (1, 1, 32, 128), 14, True),
}


def _export(name: str, path: Path) -> tuple[Path, np.ndarray]:
    """The corpus export ``name`` (random weights, seeded) and a random input of its size, batch 2 where dynamic."""
    make, shape, opset, dynamic = EXPORTS[name]
    torch.manual_seed(0)
    module = make().eval()
    x = torch.randn(*shape)
    outputs = module(x)
    names = [f"output{i}" for i in range(len(outputs) if isinstance(outputs, tuple) else 1)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=opset, input_names=["input"],
                          output_names=names,
                          dynamic_axes={n: {0: "batch"} for n in ["input", *names]} if dynamic else None)
    batch = (2,) if dynamic else (1,)
    return path, np.random.default_rng(1).standard_normal(batch + shape[1:]).astype(np.float32)


def _onnxruntime(model: Path | onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    session, _ = make_session(model if isinstance(model, onnx.ModelProto) else str(model), "cpu")
    return session.run(None, {"input": x})


def _close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert np.abs(g - w).max() <= 1e-4 * max(np.abs(w).max(), 1e-6)


@pytest.mark.parametrize("name", list(EXPORTS))
def test_to_torch_runs_a_corpus_export_as_onnxruntime_does(tmp_path: Path, name: str) -> None:
    path, x = _export(name, tmp_path / "m.onnx")
    module = onnxprune.to_torch(path)
    assert sum(p.numel() for p in module.parameters()) > 0 and all(p.requires_grad for p in module.parameters())
    with torch.no_grad():
        got = [t.numpy() for t in module(torch.from_numpy(x))]
    _close(got, _onnxruntime(path, x))


@pytest.mark.parametrize("name", ["convnext (LayerNorm, depthwise)", "efficientvit (heads)", "nms-free detector head"])
def test_from_torch_writes_the_weights_of_an_optimiser_step_into_the_same_graph(tmp_path: Path, name: str) -> None:
    path, x = _export(name, tmp_path / "m.onnx")
    module = onnxprune.to_torch(path)
    optimiser = torch.optim.SGD(module.parameters(), lr=0.1)
    loss = sum((y.float() ** 2).mean() for y in module(torch.from_numpy(x)))
    loss.backward()
    optimiser.step()
    with torch.no_grad():
        trained = [t.numpy() for t in module(torch.from_numpy(x))]
    written = onnxprune.from_torch(module, like=path, out=tmp_path / "trained.onnx", sample={"input": x})
    original = onnx.load(str(path))
    assert [n.op_type for n in written.graph.node] == [n.op_type for n in original.graph.node]
    assert [i.name for i in written.graph.input] == [i.name for i in original.graph.input]
    assert [o.name for o in written.graph.output] == [o.name for o in original.graph.output]
    _close(_onnxruntime(tmp_path / "trained.onnx", x), trained)
    assert max(np.abs(t - o).max() for t, o in zip(trained, _onnxruntime(path, x))) > 1e-3  # the step changed it


def test_from_torch_checks_on_random_inputs_where_the_model_is_static(tmp_path: Path) -> None:
    path, _ = _export("regnet (grouped)", tmp_path / "m.onnx")
    module = onnxprune.to_torch(path)
    with torch.no_grad():
        next(iter(module.parameters())).mul_(0.5)
    assert isinstance(onnxprune.from_torch(module, like=onnx.load(str(path))), onnx.ModelProto)


def test_from_torch_refuses_a_module_of_another_model_and_writes_nothing(tmp_path: Path) -> None:
    path, x = _export("unet (segmenter)", tmp_path / "m.onnx")
    other, _ = _export("densenet", tmp_path / "other.onnx")
    with pytest.raises(ModelError, match="is not in the model"):
        onnxprune.from_torch(onnxprune.to_torch(other), like=path, out=tmp_path / "out.onnx", sample=x)
    with pytest.raises(OnnxPruneError, match="not a Linear"):
        onnxprune.from_torch(torch.nn.Linear(2, 2), like=path)
    dynamic = onnx.load(str(path))
    dynamic.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "height"
    with pytest.raises(OnnxPruneError, match="dynamic dims past the batch: pass from_torch a sample"):
        onnxprune.from_torch(onnxprune.to_torch(dynamic), like=dynamic, out=tmp_path / "out.onnx")
    assert not (tmp_path / "out.onnx").exists()


def test_a_module_whose_forward_no_longer_matches_its_graph_is_refused(tmp_path: Path, monkeypatch) -> None:
    path, x = _export("unet (segmenter)", tmp_path / "m.onnx")
    module = onnxprune.to_torch(path)
    real = type(module).forward
    monkeypatch.setattr(type(module), "forward", lambda self, *a: tuple(2 * y for y in real(self, *a)))
    with pytest.raises(ModelError, match="differs from the module's by"):
        onnxprune.from_torch(module, like=path, sample=x)


def test_quantized_and_float16_models_are_refused_in_one_line(tmp_path: Path) -> None:
    from onnxconverter_common import float16

    path, _ = _export("regnet (grouped)", tmp_path / "m.onnx")
    half = float16.convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
    with pytest.raises(OnnxPruneError, match="holds float16 weights .* train the float32 model"):
        onnxprune.to_torch(half)
    model = onnx.load(str(path))
    node = onnx.helper.make_node("DequantizeLinear", ["q", "s"], ["dq"])
    model.graph.node.insert(0, node)
    with pytest.raises(OnnxPruneError, match=r"is quantized \(DequantizeLinear\): train the float model"):
        onnxprune.to_torch(model)


def test_the_usage_training_loop_runs_as_written(tiny, tmp_path: Path, monkeypatch) -> None:
    """docs/usage.md's loop, as written, on the tiny model (copied to the name it uses) and a loader of its
    calibration samples with made-up labels: the written model runs in onnxruntime and differs from the input."""
    import re
    import shutil

    usage = (Path(__file__).resolve().parents[1] / "docs/usage.md").read_text()
    (example,) = re.findall(r"### Training it yourself.*?```python\n(.*?)```", usage, re.S)
    shutil.copy(tiny.path, tmp_path / "small.onnx")
    monkeypatch.chdir(tmp_path)
    images = torch.from_numpy(tiny.x[:16])
    loader = [(images[:8], torch.arange(8) % 10), (images[8:], torch.arange(8) % 10)]
    exec(compile(example, "docs/usage.md", "exec"), {"loader": loader})
    tuned = _onnxruntime(tmp_path / "small-tuned.onnx", tiny.x[:4])[0]
    assert tuned.shape == _onnxruntime(tmp_path / "small.onnx", tiny.x[:4])[0].shape
    assert np.abs(tuned - _onnxruntime(tmp_path / "small.onnx", tiny.x[:4])[0]).max() > 1e-6
