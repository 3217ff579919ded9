"""A copy of a graph exported at a fixed batch that batches freely, and the user's batch written back."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from onnxprune.ir.graph import export_model
from onnxprune.ir.load import import_graph
from onnxprune.ir.probe import (batch_verdict, fixed_batch, node_outputs, random_feed, real_inputs, run_all_tensors,
                                run_each, static_batch)


def free_batch(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``model`` that batches freely, when its batch is fixed only by a static input dim and by constant
    ``Reshape`` targets whose first entry is that batch where the reshaped tensor's is too (rewritten to 0, "copy
    the input's dim"), and that copy at twice the batch gives what ``model`` gives on each half alone (random
    inputs); else None. An exporter often fixes the batch this way (``torch.onnx.export`` without
    ``dynamic_axes``, ultralytics' static exports, whose targets are ``Constant`` nodes or one weight read by
    several Reshapes), and running such a graph one sample at a time costs far more than batching.

    The copy is the normalised graph the analysis reads (``import_graph``: constants folded, a ``Resize`` sized by
    constant sizes, batch included, given the equal scales)."""
    fixed = static_batch(model)
    if fixed is None or any(d.dim_value <= 0 for v in real_inputs(model) for d in v.type.tensor_type.shape.dim):
        return None  # a batch free already, or other dims unknown: nothing to check the copy on
    free = export_model(import_graph(model))
    _free_reshapes(free, fixed.size)
    del free.graph.value_info[:]
    for value in [*real_inputs(free), *free.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims and dims[0].dim_value > 0:
            dims[0].dim_param = "N"
    feed = random_feed(real_inputs(model), fixed.size * 2)
    names = [o.name for o in model.graph.output]
    if fixed.size == 1:  # the verdict's run at batch 2 is the copy's run at twice the batch: one run serves both
        both = run_all_tensors(free, list(dict.fromkeys([*node_outputs(free), *names])), feed)
        if batch_verdict(free, both, feed) is not None:
            return None
    elif fixed_batch(free, feed) is not None:
        return None
    else:
        both = run_all_tensors(free, names, feed)
    halves = [{k: v[half * fixed.size:(half + 1) * fixed.size] for k, v in feed.items()} for half in range(2)]
    alone = run_each(model, names, halves)
    if both is None or None in alone or any(
            not same_samples(both[k][half * fixed.size:(half + 1) * fixed.size], alone[half][k])
            for half in range(2) for k in names):
        return None
    return free


def same_samples(together: np.ndarray, alone: np.ndarray) -> bool:
    """Whether an output computed with other samples in the batch is the one computed alone, up to float rounding:
    relatively 1e-4, and absolutely 1e-5 of the output's largest magnitude (at least 1e-5). The rounding scales
    with the output: VGG-11's Gemm over 25088 columns sums in another order at batch 2 and moves an output near 0 by
    1.5e-5 where its outputs reach 16, which a fixed 1e-5 refused; a graph that mixes samples moves them by their
    own size."""
    scale = float(np.max(np.abs(alone), initial=0.0))
    return np.allclose(together, alone, rtol=1e-4, atol=1e-5 * max(1.0, scale))


def _free_reshapes(model: onnx.ModelProto, size: int) -> None:
    """Give each ``Reshape`` whose constant target starts with the batch ``size``, and whose input's first dim is
    that batch (or unknown), a target of its own starting with 0 (-1 under ``allowzero``), in place."""
    weights = {init.name: init for init in model.graph.initializer}
    lead = {v.name: v.type.tensor_type.shape.dim[0] for v in [*model.graph.value_info, *model.graph.input]
            if v.type.tensor_type.shape.dim}
    for k, node in enumerate(model.graph.node):
        init = weights.get(node.input[1]) if node.op_type == "Reshape" and len(node.input) > 1 else None
        target = None if init is None else numpy_helper.to_array(init)
        if target is None or target.ndim != 1 or len(target) < 2 or target[0] != size:
            continue
        dim = lead.get(node.input[0])
        if dim is not None and dim.HasField("dim_value") and dim.dim_value != size:
            continue  # its leading 1 is not the batch
        allowzero = any(a.name == "allowzero" and a.i for a in node.attribute)
        if allowzero and -1 in target:
            continue
        name = f"{init.name}.free{k}"
        new = np.concatenate([[-1 if allowzero else 0], target[1:]]).astype(target.dtype)
        model.graph.initializer.append(numpy_helper.from_array(new, name))
        node.input[1] = name


def restore_batch(model: onnx.ModelProto, original: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (pruned from ``free_batch(original)``) with ``original``'s input and output shapes written back
    (the user's fixed batch), the inner shapes left to be inferred again."""
    shapes = {v.name: v.type for v in [*real_inputs(original), *original.graph.output]}
    del model.graph.value_info[:]
    for value in [*real_inputs(model), *model.graph.output]:
        if value.name in shapes:
            value.type.CopyFrom(shapes[value.name])
    return model
