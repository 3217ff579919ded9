"""One onnxruntime run on random inputs, to learn what a graph does with shapes and with the batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx

from onnxprune.runtime.ort import make_session


def real_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs that are not initializers."""
    weights = {init.name for init in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in weights]


def random_feed(inputs: list[onnx.ValueInfoProto], batch: int | None, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard-normal floats (zeros for other types) shaped like ``inputs`` (static dims), the first dim
    set to ``batch`` unless it is None."""
    rng = np.random.default_rng(seed)
    feed = {}
    for v in inputs:
        dims = [d.dim_value for d in v.type.tensor_type.shape.dim]
        if batch is not None:
            dims[0] = batch
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type))
        feed[v.name] = (rng.standard_normal(dims) if dtype.kind == "f" else np.zeros(dims)).astype(dtype)
    return feed


def run_all_tensors(model: onnx.ModelProto, names: Sequence[str], feed: dict[str, np.ndarray]
                    ) -> dict[str, np.ndarray] | None:
    """The tensors ``names`` of one onnxruntime run of ``model`` on ``feed``, or None when onnxruntime
    cannot run it on that feed (a batch the graph does not take, say)."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.value_info[:]
    present = {v.name for v in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in present)
    try:
        session, _ = make_session(probe, "cpu")
        arrays = session.run(list(names), feed)
    except Exception:  # noqa: BLE001 - onnxruntime's own errors: a graph it cannot run on this feed
        return None
    return dict(zip(names, arrays))


@dataclass(frozen=True)
class FixedBatch:
    """The batch a graph must run at, and why."""

    size: int
    reason: str


def fixed_batch(model: onnx.ModelProto, feed: dict[str, np.ndarray] | None = None) -> FixedBatch | None:
    """None when samples can be batched freely, else the batch the graph was exported for.

    An input with a static batch dim fixes it. With a dynamic one, the graph runs once at batch 2 (on the
    first two samples of ``feed``, else on random inputs of the static input dims): a floating-point
    tensor without a leading dim of 2 (a ``Reshape`` to ``[1, C, -1]`` folds the batch into another axis)
    or a failed run means the graph holds batch 1 as a constant, and running several samples at once would
    mix them without any error."""
    inputs = real_inputs(model)
    static = {v.type.tensor_type.shape.dim[0].dim_value for v in inputs
              if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].dim_value > 0}
    if static:
        size = min(static)
        return FixedBatch(size, f"input {inputs[0].name!r} has a static batch of {size}")
    if feed is None:
        feed = random_feed(inputs, 2)
    else:
        feed = {k: np.concatenate([v[:2]] * (2 if len(v) < 2 else 1))[:2] for k, v in feed.items()}
    names = [o for n in model.graph.node for o in n.output if o]
    arrays = run_all_tensors(model, names, feed)
    if arrays is None:
        return FixedBatch(1, "onnxruntime cannot run the graph at batch 2")
    for node in model.graph.node:
        for name in node.output:
            a = arrays.get(name)
            if a is not None and a.dtype.kind == "f" and (a.ndim == 0 or a.shape[0] != 2):
                return FixedBatch(1, f"{node.op_type} {node.name or name} gives {name} shape {list(a.shape)} at "
                                     "batch 2: the graph writes batch 1 into its shapes")
    return None
