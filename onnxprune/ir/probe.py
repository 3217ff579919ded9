"""One onnxruntime run on random inputs, to learn what a graph does with shapes and with the batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from onnxprune.ir.ort import session_of, weights_aside


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


def run_all_tensors(model: onnx.ModelProto, names: Sequence[str], feed: dict[str, np.ndarray],
                    weights: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray] | None:
    """The tensors ``names`` of one onnxruntime run of ``model`` on ``feed``, or None when onnxruntime
    cannot run it on that feed (a batch the graph does not take, say). ``weights``: the arrays of the in-memory
    stubs among ``model``'s initializers (``ir.ort.in_memory``), read only here."""
    return run_each(model, names, [feed], weights)[0]


def run_each(model: onnx.ModelProto, names: Sequence[str], feeds: Sequence[dict[str, np.ndarray]],
             weights: Mapping[str, np.ndarray] | None = None) -> list[dict[str, np.ndarray] | None]:
    """``run_all_tensors`` on each of ``feeds``, from one session (the weights are read and copied into onnxruntime
    once: VGG-11's 530 MB, 0.9 s a session); None for a feed onnxruntime cannot run, or for all where it cannot
    load the model."""
    light, aside = weights_aside(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(light)  # the large weights stay out of the copy
    del probe.graph.value_info[:]
    present = {v.name for v in probe.graph.output}
    probe.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names if n not in present)
    try:
        session, _ = session_of(probe, {**aside, **(weights or {})}, "cpu", quiet=True, prepack=False)
    except Exception:  # noqa: BLE001 - onnxruntime's own errors: a graph it cannot load
        return [None] * len(feeds)
    return [_run(session, names, feed) for feed in feeds]


def _run(session: ort.InferenceSession, names: Sequence[str], feed: dict[str, np.ndarray]
         ) -> dict[str, np.ndarray] | None:
    """The tensors ``names`` of one run on ``feed``, or None where onnxruntime cannot run it (a batch it does not
    take, say)."""
    try:
        return dict(zip(names, session.run(list(names), feed)))
    except Exception:  # noqa: BLE001 - onnxruntime's own errors
        return None


SHAPE_READERS = ("Shape", "Size")  # read a tensor's dims, not its values


def input_dependent(model: onnx.ModelProto) -> set[str]:
    """The tensors computed from a graph input's values (a node with a subgraph counts as reading every input;
    ``Shape`` and ``Size`` read only dims: a YOLOv8 head's anchor grid, sized from a feature map's shape, holds
    no sample)."""
    data = {v.name for v in real_inputs(model)}
    for node in model.graph.node:
        subgraph = any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)
        if subgraph or (node.op_type not in SHAPE_READERS and any(name in data for name in node.input)):
            data.update(o for o in node.output if o)
    return data


@dataclass(frozen=True)
class FixedBatch:
    """The batch a graph must run at, and why."""

    size: int
    reason: str


def static_batch(model: onnx.ModelProto) -> FixedBatch | None:
    """The batch an input's static leading dim fixes, if one does."""
    inputs = real_inputs(model)
    static = {v.type.tensor_type.shape.dim[0].dim_value for v in inputs
              if v.type.tensor_type.shape.dim and v.type.tensor_type.shape.dim[0].dim_value > 0}
    if not static:
        return None
    return FixedBatch(min(static), f"input {inputs[0].name!r} has a static batch of {min(static)}")


def fixed_batch(model: onnx.ModelProto, feed: dict[str, np.ndarray] | None = None,
                weights: Mapping[str, np.ndarray] | None = None) -> FixedBatch | None:
    """None when samples can be batched freely, else the batch the graph was exported for (``weights``: the arrays of
    the in-memory stubs among ``model``'s initializers, as ``ir.ort.light_export`` gives them).

    An input with a static batch dim fixes it. With a dynamic one, the graph runs once at batch 2 (on the
    first two samples of ``feed``, else on random inputs of the static input dims): a floating-point
    tensor without a leading dim of 2 (a ``Reshape`` to ``[1, C, -1]`` folds the batch into another axis)
    or a failed run means the graph holds batch 1 as a constant, and running several samples at once would
    mix them without any error; unless that tensor has its batch on another axis (time-major: the one axis that
    is 1 at batch 1 and 2 at batch 2)."""
    inputs = real_inputs(model)
    static = static_batch(model)
    if static is not None:
        return static
    if feed is None:
        feed = random_feed(inputs, 2)
    else:
        feed = {k: np.concatenate([v[:2]] * (2 if len(v) < 2 else 1))[:2] for k, v in feed.items()}
    return batch_verdict(model, run_all_tensors(model, node_outputs(model), feed, weights), feed, weights)


def node_outputs(model: onnx.ModelProto) -> list[str]:
    """Every tensor a node of ``model`` writes (what ``batch_verdict`` reads a run of)."""
    return [o for n in model.graph.node for o in n.output if o]


def batch_verdict(model: onnx.ModelProto, arrays: dict[str, np.ndarray] | None, feed: dict[str, np.ndarray],
                  weights: Mapping[str, np.ndarray] | None = None) -> FixedBatch | None:
    """``fixed_batch``'s verdict on a graph whose batch is not static, from its run on ``feed`` (two samples):
    ``arrays``, the tensors ``node_outputs`` names (None: onnxruntime could not run it)."""
    if arrays is None:
        return FixedBatch(1, "onnxruntime cannot run the graph at batch 2")
    read = {name for node in model.graph.node for name in node.input} | {o.name for o in model.graph.output}
    data = input_dependent(model)
    for node in model.graph.node:
        for name in node.output:
            # unread (a Loop's carried weights) or not computed from an input (an Identity of a weight)
            a = arrays.get(name) if name in read and name in data else None
            if a is not None and a.dtype.kind == "f" and (a.ndim == 0 or a.shape[0] != 2):
                where = f"{node.op_type} {node.name or name} gives {name} shape {list(a.shape)} at batch 2"
                why = _batch_reason(model, name, a.shape, {k: v[:1] for k, v in feed.items()}, weights)
                if why is not None:
                    return FixedBatch(1, f"{where}: {why}")
    return None


def _batch_reason(model: onnx.ModelProto, name: str, at2: tuple[int, ...], feed1: dict[str, np.ndarray],
                  weights: Mapping[str, np.ndarray] | None) -> str | None:
    """Why tensor ``name`` (shape ``at2`` at batch 2) does not hold samples apart, or None when it does on an axis
    other than 0 (time-major: the one axis that is 1 at batch 1, on ``feed1``, and 2 at batch 2)."""
    at1 = (run_all_tensors(model, [name], feed1, weights) or {}).get(name)
    moved = [] if at1 is None or at1.ndim != len(at2) else [
        i for i, (a, b) in enumerate(zip(at1.shape, at2)) if a != b]
    if len(moved) == 1 and (at1.shape[moved[0]], at2[moved[0]]) == (1, 2):
        return None
    if len(moved) == 1 and at2[moved[0]] == 2 * at1.shape[moved[0]]:
        return (f"the batch is merged with another dim on its axis {moved[0]} ({at1.shape[moved[0]]} at batch 1), "
                "so its samples cannot be held apart")
    return "the graph writes batch 1 into its shapes"
