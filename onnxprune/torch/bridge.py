"""``to_torch``: an ONNX model as a trainable ``torch.nn.Module``; ``from_torch``: its weights written back.

The module is the graph-to-torch engine ``recover`` trains with (``torch.engine.TorchGraph``): every float
initializer a parameter, every node a kernel of the op registry, outputs equal to onnxruntime's. The model is read
as its file holds it (no load rewrite), so that the written model is the same graph with new weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
import torch

from onnxprune.errors import ModelError, OnnxPruneError
from onnxprune.fileio import save_model
from onnxprune.ir.load import load_model
from onnxprune.ir.ort import make_session
from onnxprune.ir.probe import random_feed, real_inputs
from onnxprune.torch.engine import TorchGraph, device_of, write_back, writeback_error, writeback_tolerance

# a path, a ModelProto, or what holds one as ``.model`` (``onnxprune.Result``)
Model = Union[str, Path, onnx.ModelProto, Any]
QUANTIZED = frozenset({"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
                       "MatMulInteger", "DynamicQuantizeLinear"})
HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)


def _model(model: Model) -> tuple[onnx.ModelProto, str]:
    """The ModelProto and how to name it in a message."""
    if isinstance(model, (str, Path)):
        return load_model(model), str(model)
    proto = getattr(model, "model", model)
    if not isinstance(proto, onnx.ModelProto):
        raise OnnxPruneError(f"expected an ONNX model (a path, an onnx.ModelProto or an onnxprune Result), got "
                             f"{type(model).__name__}")
    return proto, proto.graph.name or "the model"


def _trainable(model: onnx.ModelProto, name: str) -> None:
    """OnnxPruneError where the model's weights are not float32: INT8 (quantized) or float16 weights."""
    quantized = sorted({n.op_type for n in model.graph.node} & QUANTIZED)
    if quantized:
        raise OnnxPruneError(f"{name} is quantized ({', '.join(quantized)}): train the float model, then quantize "
                             "it again (onnxprune quantize)")
    half = [t.name for t in model.graph.initializer if t.data_type in HALF]
    if half:
        raise OnnxPruneError(f"{name} holds float16 weights (e.g. {half[0]!r}): train the float32 model it was "
                             "converted from, then convert the result")


def to_torch(model: Model) -> TorchGraph:
    """``model`` as a ``torch.nn.Module`` whose parameters are its float weights (shared weights stay one
    parameter) and whose ``forward(*inputs)`` returns the graph's outputs as a tuple, in order, equal to
    onnxruntime's: train it as any module (``.to("cuda")``, any optimiser), then ``from_torch`` writes it back.

    Raises UnsupportedOpError naming every op the engine cannot run, OnnxPruneError for an INT8 or float16
    model."""
    proto, name = _model(model)
    _trainable(proto, name)
    return TorchGraph(proto)


def from_torch(module: TorchGraph, like: Model, out: str | Path | None = None, *,
               sample: Mapping[str, np.ndarray] | np.ndarray | None = None) -> onnx.ModelProto:
    """The model ``like`` (what ``to_torch`` was given) with ``module``'s trained weights: the same graph, inputs and
    outputs. Before it is returned (and written to ``out``, atomically), onnxruntime runs it on ``sample`` (one
    array per input; default: random values, where the inputs' dims other than the batch are static) and its
    outputs must equal the module's within float32 kernels' error (``writeback_tolerance``): a ModelError says by
    how much they differ otherwise."""
    if not isinstance(module, TorchGraph):
        raise OnnxPruneError(f"from_torch writes back a module made by onnxprune.to_torch, not a "
                             f"{type(module).__name__}")
    proto, name = _model(like)
    _trainable(proto, name)
    written = write_back(proto, module)
    feed = _sample(written, name, sample)
    session, _ = make_session(written, "cpu", arena=False, quiet=True)
    got = session.run(None, feed)
    device = device_of(module)
    with torch.no_grad():
        want = [t.detach().cpu().numpy() for t in module(*(torch.from_numpy(feed[n]).to(device)
                                                           for n in module.input_names))]
    tolerance = writeback_tolerance(device)
    for output, g, w in zip(module.output_names, got, want):
        error = writeback_error(g, w)
        if not error <= tolerance:
            raise ModelError(f"{name}: the written model's output {output!r} differs from the module's by "
                             f"{error:.2e} (relative), past {tolerance:.0e}: the module was not made from this model "
                             "by onnxprune.to_torch, or its forward was changed")
    if out is not None:
        save_model(written, Path(out))
    return written


def _sample(model: onnx.ModelProto, name: str, sample: Mapping[str, np.ndarray] | np.ndarray | None
            ) -> dict[str, np.ndarray]:
    """The check's inputs: ``sample`` by input name, or random values where every dim but the batch is static."""
    inputs = real_inputs(model)
    if sample is not None:
        feed = dict(sample) if isinstance(sample, Mapping) else {inputs[0].name: np.asarray(sample)}
        missing = [v.name for v in inputs if v.name not in feed]
        if missing:
            raise OnnxPruneError(f"from_torch's sample lacks the input(s) {missing} of {name}")
        return feed
    dynamic = [v.name for v in inputs if any(not d.dim_value for d in v.type.tensor_type.shape.dim[1:])]
    if dynamic:
        raise OnnxPruneError(f"{name}'s input {dynamic[0]!r} has dynamic dims past the batch: pass from_torch a "
                             "sample=... of the size it runs at")
    static = all(v.type.tensor_type.shape.dim[0].dim_value for v in inputs)
    return random_feed(inputs, batch=None if static else 1)
