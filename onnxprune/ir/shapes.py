"""Shapes an exported graph leaves unknown or computes at run time: ONNX inference, onnxruntime runs at batch 1
and 2, and the folding of shape-only values into constants."""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.ir.graph import const_value, export_model, rebuilt, shape_producer, static_shape
from onnxprune.ir.inputs import fix_input_shapes
from onnxprune.ir.probe import random_feed, real_inputs, run_each


_WEIGHT = 1024
"""Elements from which a float initializer counts as a weight: inference reads only its type and shape."""

_INTEGER_TYPES = frozenset({onnx.TensorProto.INT64, onnx.TensorProto.INT32, onnx.TensorProto.INT16,
                            onnx.TensorProto.INT8, onnx.TensorProto.UINT64, onnx.TensorProto.UINT32,
                            onnx.TensorProto.UINT16, onnx.TensorProto.UINT8, onnx.TensorProto.BOOL})


def weight_type(data_type: int) -> bool:
    """Whether shape inference reads an initializer of this ONNX type only as a type and shape: not an integer or
    bool table, whose values data propagation may read, not a string."""
    return data_type not in _INTEGER_TYPES and data_type != onnx.TensorProto.STRING


def without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for shape inference: its weights as graph inputs of their type and shape (inference reads nothing
    else of them), integer and small initializers kept for data propagation; ``model`` itself when it has none.
    onnx hands the serialised model to its C++ side and parses the result back, four passes over the weights' bytes
    (VGG-11's 530 MB: 2.5 s a call)."""
    graph = model.graph
    heavy = {t.name for t in graph.initializer
             if weight_type(t.data_type) and int(np.prod(t.dims, dtype=np.int64)) > _WEIGHT}
    if not heavy:
        return model
    declared = {v.name for v in graph.input}
    return rebuilt(model, [t for t in graph.initializer if t.name not in heavy],
                   [onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims)
                    for t in graph.initializer if t.name in heavy and t.name not in declared])


def onnx_infer(model: onnx.ModelProto, data_prop: bool = False) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` of ``model``, run on ``without_weights(model)``: the same model out."""
    light = without_weights(model)
    if light is model:
        return onnx.shape_inference.infer_shapes(model, data_prop=data_prop)
    inferred = onnx.shape_inference.infer_shapes(light, data_prop=data_prop).graph
    out = onnx.ModelProto()
    out.CopyFrom(model)  # a memory copy (repeated-field extends of the weights take 3× longer)
    for field in ("node", "output", "value_info"):
        del getattr(out.graph, field)[:]
        getattr(out.graph, field).extend(getattr(inferred, field))
    return out


def infer_shapes(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """ONNX shape inference with data propagation (shapes of Reshape targets etc.); ``weights``: the arrays of the
    in-memory stubs among ``model``'s initializers, for ``fill_shapes_from_run``.

    With a dynamic batch, dims that symbolic inference leaves unknown (a Reshape to ``[batch, C, -1]``)
    are taken from inference at batch 1 and at batch 2 where both agree: they do not depend on the batch.
    Dims that are 1 and 2 there are the batch: they get the input's batch symbol; dims that are k and 2k fold k
    rows a sample into the batch (a vision transformer's patches): ``folded_symbol``."""
    try:
        inferred = onnx_infer(model, data_prop=True)
    except Exception:  # inference is best effort: analysis reports missing shapes itself
        return model
    return fill_shapes_from_run(_fill_per_sample_dims(inferred), weights)


def folded_symbol(batch_symbol: str, rows: int) -> str:
    """The dim param of an axis holding ``rows`` rows a sample for each of ``batch_symbol`` samples."""
    return f"{batch_symbol}*{rows}"


def folds_of(dim: object) -> int | None:
    """The rows a sample that a dim written by ``folded_symbol`` holds, else None."""
    match = re.fullmatch(r".+\*(\d+)", dim) if isinstance(dim, str) else None
    return int(match[1]) if match else None


def graph_batch(graph: gs.Graph) -> int | None:
    """The static batch every graph input of rank ≥ 1 declares on its first axis (None: dynamic, or they differ)."""
    shapes = [static_shape(t) for t in graph.inputs]
    firsts = {shape[0] if shape else None for shape in shapes if shape != []}
    first = firsts.pop() if len(firsts) == 1 else None
    return first if isinstance(first, int) and first > 0 else None


def sample_rows(tensor: gs.Tensor, batch: int | None) -> int:
    """The rows a sample on ``tensor``'s first axis: k where the graph folds k rows a sample into its batch (a vision
    transformer's patches: ``N*k`` at a dynamic batch, ``[k, ...]`` at a static batch of 1), else 1. Only tensors
    whose other dims are static (what a Reshape to samples first needs)."""
    shape = tensor.shape
    if not shape or len(shape) < 2 or not all(isinstance(d, (int, np.integer)) and d > 0 for d in shape[1:]):
        return 1
    first = shape[0]
    if rows := folds_of(first):
        return rows
    return int(first) if batch == 1 and isinstance(first, (int, np.integer)) and first > 1 else 1


def per_batch(at1: int | None, at2: int | None, symbol: str) -> str | None:
    """The symbolic dim of a dim that is ``at1`` at batch 1 and ``at2`` at batch 2: the batch (1, 2), k rows a
    sample folded into it (k, 2k), else None (unknown)."""
    if at1 is None or at2 is None or at1 < 1 or at2 != 2 * at1:
        return None
    return symbol if at1 == 1 else folded_symbol(symbol, at1)


def _run_dim(at1: int, at2: int, symbol: str | None, varying: bool) -> str | None:
    """A dim that two runs (batch 1, 2) gave differently: the batch, or rows folded into it (``per_batch``); after a
    data-shaped op only the batch itself (a decoded count of k and 2k is no fold), else unknown."""
    if symbol is None or varying and (at1, at2) != (1, 2):
        return None
    return per_batch(at1, at2, symbol)


def _known(value: onnx.ValueInfoProto, start: int = 0) -> bool:
    """Whether every dim of ``value`` from ``start`` on is a number (no shape or no tensor: True)."""
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return True
    return all(d.dim_value > 0 for d in value.type.tensor_type.shape.dim[start:])


def _fill_per_sample_dims(model: onnx.ModelProto) -> onnx.ModelProto:
    inputs = real_inputs(model)
    values = [*model.graph.value_info, *model.graph.output]
    if (not inputs or any(not v.type.tensor_type.shape.dim or not _known(v, 1) for v in inputs)
            or all(_known(v, 0) for v in inputs) or all(_known(v) for v in values)):
        return model  # nothing to fill, or inputs with dynamic dims beyond the batch
    symbols = {v.type.tensor_type.shape.dim[0].dim_param for v in inputs if not _known(v)}
    batch_symbol = symbols.pop() if len(symbols) == 1 else ""
    runs, light = [], without_weights(model)  # only the inferred shapes are read: no copy of the weights
    for batch in (1, 2):
        shapes = {v.name: [batch, *(d.dim_value for d in v.type.tensor_type.shape.dim[1:])] for v in inputs}
        try:
            done = onnx.shape_inference.infer_shapes(fix_input_shapes(light, shapes), data_prop=True)
        except Exception:  # best effort, as above
            return model
        runs.append({v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
                     for v in [*done.graph.value_info, *done.graph.output] if v.type.HasField("tensor_type")})
    for value in values:
        if _known(value):
            continue
        dims = value.type.tensor_type.shape.dim
        at1, at2 = runs[0].get(value.name), runs[1].get(value.name)
        if at1 is None or at2 is None or not len(dims) == len(at1) == len(at2):
            continue
        for d, a, b in zip(dims, at1, at2):
            if not d.HasField("dim_value") and a is not None and a == b:
                d.dim_value = a
            elif not d.HasField("dim_value") and batch_symbol and per_batch(a, b, batch_symbol):
                d.dim_param = per_batch(a, b, batch_symbol)
    return model


def fill_shapes_from_run(model: onnx.ModelProto, weights: Mapping[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """Shapes that inference left unknown, taken from onnxruntime runs on random inputs.

    Exporters compute shapes in the graph (``Shape → Gather → Concat → Reshape``, tf2onnx's computed
    ``Pads``) where ONNX shape inference stops, yet one run at the declared input shape knows them all.
    With a dynamic batch the model runs at batch 1 and 2: a dim equal in both is static, a dim that is
    1 and 2 is the batch (the input's batch symbol), k and 2k k rows a sample folded into it. Needs static non-batch
    input dims (``--input-shape``); returns ``model`` unchanged when nothing is missing or the runs fail.
    ``weights``: the arrays of the in-memory stubs among ``model``'s initializers (read only if it runs)."""
    inputs = real_inputs(model)
    if not inputs or any(not v.type.tensor_type.shape.dim or not _known(v, 1) for v in inputs):
        return model
    symbols = {v.type.tensor_type.shape.dim[0].dim_param for v in inputs if not _known(v)}
    if len(symbols) > 1:
        return model
    symbol = symbols.pop() if symbols else None
    values = {v.name: v for v in [*model.graph.value_info, *model.graph.output]}

    def complete(name: str) -> bool:
        v = values.get(name)
        return (v is not None and v.type.tensor_type.HasField("shape")
                and all(d.HasField("dim_value") or (symbol and (d.dim_param == symbol or folds_of(d.dim_param)))
                        for d in v.type.tensor_type.shape.dim))

    outputs = {v.name for v in model.graph.output}  # as declared: what the written model promises its users
    missing = [o for n in model.graph.node for o in n.output if o and o not in outputs and not complete(o)]
    if not missing:
        return model
    feeds = [random_feed(inputs, b, seed=b or 0) for b in ((1, 2) if symbol else (None,))]
    runs = run_each(model, missing, feeds, weights)
    if runs[0] is None:
        return model
    filled = onnx.ModelProto()
    filled.CopyFrom(model)
    keep = [v for v in filled.graph.value_info if v.name not in set(missing)]
    del filled.graph.value_info[:]
    filled.graph.value_info.extend(keep)
    varying = after_data_shaped(model)
    for name in missing:
        at1 = runs[0][name]
        at2 = runs[1][name] if len(runs) > 1 and runs[1] is not None else at1
        if at1.ndim != at2.ndim:
            continue
        dims = [a if a == b and name not in varying else _run_dim(a, b, symbol, name in varying)
                for a, b in zip(at1.shape, at2.shape)]
        filled.graph.value_info.append(
            onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(at1.dtype), dims))
    return filled


def _shape_source(piece: gs.Tensor) -> tuple[gs.Tensor, int] | None:
    """``(t, i)`` when the vector ``piece`` is ``Shape(t)[i:i + len(piece)]`` (Gather of one entry,
    Unsqueeze of a scalar Gather, or a Slice with step 1; integer Casts between them, as Paddle exports
    write them, are looked through), else None."""
    node = shape_producer(piece)
    if node is not None and node.op == "Unsqueeze":
        node = shape_producer(node.inputs[0])
    if node is None or node.op not in ("Gather", "Slice"):
        return None
    shape_node = shape_producer(node.inputs[0])
    if shape_node is None or shape_node.op != "Shape" or shape_node.attrs.get("start", 0) != 0:
        return None
    params = [const_value(t) for t in node.inputs[1:]]
    if any(v is None or v.size != 1 for v in params):
        return None
    first = [int(v.reshape(-1)[0]) for v in params]
    if node.op == "Gather" and int(node.attrs.get("axis", 0)) == 0:
        return shape_node.inputs[0], first[0]
    if node.op == "Slice" and first[2:3] in ([], [0]) and first[3:4] in ([], [1]):
        return shape_node.inputs[0], first[0]
    return None


def _copied(x: gs.Tensor, pos: int, t: gs.Tensor, i: int) -> int | None:
    """The constant for entry ``pos`` of a Reshape target of ``x`` that reads ``Shape(t)[i]``: 0 ("copy the
    input's dim") when it is x's own dim ``pos`` or the same symbolic dim (the batch), t's size when that
    is static, else None."""
    x_shape, t_shape = x.shape, t.shape
    if t_shape is None or i >= len(t_shape):
        return None
    if t is x and i == pos or pos < len(x_shape) and isinstance(x_shape[pos], str) and t_shape[i] == x_shape[pos]:
        return 0
    return int(t_shape[i]) if isinstance(t_shape[i], (int, np.integer)) and t_shape[i] >= 0 else None


def copy_batch_dims(graph: gs.Graph) -> bool:
    """In Reshape targets built as ``Concat(..., Shape(t)[i:j], ...)`` (torch's ``flatten(start_dim)``
    and batch-size arithmetic), write 0 ("copy the input's dim") for an entry that is the Reshape input's
    own dim at that position or the same symbolic dim (the batch), and static sizes as constants.

    The target then folds to a constant, so no batch-size tensor (which has no batch axis) has to be
    computed ahead and cached across the cuts of ``compress``. Returns whether a target changed."""
    changed = 0
    for node in list(graph.nodes):
        target = node.inputs[1] if node.op == "Reshape" and len(node.inputs) > 1 else None
        x_shape = node.inputs[0].shape if target is not None else None
        if (x_shape is None or node.attrs.get("allowzero", 0) or len(target.inputs) != 1
                or target.inputs[0].op != "Concat"):
            continue
        pieces, pos = [], 0
        for piece in target.inputs[0].inputs:
            shape = static_shape(piece)
            if shape is None or len(shape) != 1 or shape[0] is None:
                break
            src = _shape_source(piece)
            entries = None if src is None else [_copied(node.inputs[0], pos + k, src[0], src[1] + k) for k in range(shape[0])]
            if entries is not None and None not in entries:
                piece = gs.Constant(f"{target.name}.copy{changed}.{pos}", np.array(entries, np.int64))
            pieces.append(piece)
            pos += shape[0]
        else:
            if any(a is not b for a, b in zip(pieces, target.inputs[0].inputs)):
                changed += 1
                new = gs.Variable(f"{target.name}.copy{changed}", dtype=np.int64, shape=target.shape)
                graph.nodes.append(gs.Node("Concat", f"{target.inputs[0].name}.copy{changed}", {"axis": 0}, pieces, [new]))
                node.inputs[1] = new
    return changed > 0


# ops whose output shape depends on input values, not shapes: a Shape read after one is known only at run time
_DATA_SHAPED = frozenset({"Loop", "If", "Scan", "NonZero", "NonMaxSuppression", "Unique", "Compress"})


def after_data_shaped(model: onnx.ModelProto) -> set[str]:
    """The tensors computed after an op of ``_DATA_SHAPED`` (a decoded sequence, say): a dim that one run shows
    is not known to be static (the next input may decode a longer sequence)."""
    after: set[str] = set()
    for node in model.graph.node:
        if node.op_type in _DATA_SHAPED or any(name in after for name in node.input):
            after.update(o for o in node.output if o)
    return after


_SIZED_BY_INPUT = frozenset({"Reshape", "Expand", "Tile", "Range", "ConstantOfShape", "Slice", "Resize", "Upsample",
                             "Pad", "TopK", "OneHot", "Split"})


_SMALL = 64  # entries: a shape vector, not a feature map


def resize_by_scales(graph: gs.Graph) -> bool:
    """Give a Resize sized by ``sizes`` (computed in the graph, ``Concat(Shape(x)[0:2], [H, W])`` as Paddle's
    interpolate writes it, or a constant, as a static-shape PyTorch export folds ``interpolate(x, size=y.shape[2:])``)
    the equal ``scales`` instead, where its input and output shapes past the batch are static and onnxruntime's
    output size ``floor(in · scale)`` gives them back: the sizes' batch and channel entries would otherwise be a
    batch written into the graph and a channel count that pruning leaves stale. ONNX derives the scales from the
    sizes the same way, so the result is the same. Returns whether a Resize changed."""
    changed = False
    for node in graph.nodes:
        if node.op != "Resize" or len(node.inputs) != 4 or "axes" in node.attrs:
            continue
        i_shape, o_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
        if i_shape is None or o_shape is None or len(i_shape) != len(o_shape) or None in i_shape[1:] + o_shape[1:]:
            continue
        scales = np.array([1.0] + [o / i for i, o in zip(i_shape[1:], o_shape[1:])], np.float32)
        if any(int(np.floor(np.float32(i) * s)) != o for i, s, o in zip(i_shape[1:], scales[1:], o_shape[1:])):
            continue
        node.inputs = [*node.inputs[:2], gs.Constant(f"{node.name}.scales", scales)]
        changed = True
    return changed


def fold_shape_values(graph: gs.Graph) -> bool:
    """Replace each value computed from tensor shapes alone (``Shape → Cast → Slice → ... → Concat``, as Paddle
    and TF exports read a feature map's channel or spatial count) by its constant, where a run at batch 1 and
    one at batch 2 give the same value: with the inputs' other dims fixed it cannot change. A channel count read
    this way then is a constant the pruning passes can rewrite, and no batch-less tensor is cached between cuts.
    A Reshape target that follows the batch folds with -1 where the batch goes (``_batch_free_target``); other values
    that follow it stay computed (``copy_batch_dims``). Returns whether a value was folded."""
    inputs = [t for t in graph.inputs if not isinstance(t, gs.Constant)]
    if not inputs or any(t.shape is None or any(not isinstance(d, (int, np.integer)) for d in t.shape[1:])
                         for t in inputs):
        return False
    shaped: set[int] = set()  # ids of tensors computed from shapes and constants only
    data_shaped: set[int] = set()  # ids of tensors whose shape depends on input values
    for node in graph.nodes:
        vars_in = [t for t in node.inputs if isinstance(t, gs.Variable)]
        if (node.op in _DATA_SHAPED or any(id(t) in data_shaped for t in vars_in)
                or node.op in _SIZED_BY_INPUT and any(id(t) not in shaped for t in vars_in[1:])):
            data_shaped.update(id(t) for t in node.outputs)
        if node.op in ("Shape", "Size") and vars_in and id(vars_in[0]) not in data_shaped or (
                node.op not in _DATA_SHAPED and vars_in and all(id(t) in shaped for t in vars_in)):
            shaped.update(id(t) for t in node.outputs)
    outputs = {id(t) for t in graph.outputs}
    names = sorted({t.name for node in graph.nodes for t in node.outputs if id(t) in shaped and id(t) not in outputs
                    and t.outputs and (t.shape is None or np.prod([d if isinstance(d, int) else _SMALL + 1
                                                                   for d in t.shape]) <= _SMALL)})
    if not names:
        return False
    model = export_model(graph.copy())
    symbolic = any(isinstance(t.shape[0], str) or t.shape[0] is None for t in inputs)
    feeds = [random_feed(real_inputs(model), b, seed=b) for b in ((1, 2) if symbolic else (None,))]
    runs = run_each(model, names, feeds)
    if any(r is None for r in runs):
        return False
    tensors = graph.tensors()
    folded = False
    for name in names:
        values = [r[name] for r in runs]
        tensor = tensors[name]
        if values[0].size > _SMALL or any(v.shape != values[0].shape for v in values):
            continue
        if all(np.array_equal(v, values[0]) for v in values):
            tensor.inputs.clear()
            tensor.to_constant(values[0])
            folded = True
        elif (target := _batch_free_target(tensor, values)) is not None:
            tensor.inputs.clear()
            tensor.to_constant(target)
            folded = True
    return folded


def _batch_free_target(tensor: gs.Tensor, values: list[np.ndarray]) -> np.ndarray | None:
    """A Reshape target that follows the batch, ``values`` at batch 1 and 2, as a constant: its one entry that is k
    and 2k there (the batch, or k rows a sample folded into it: MobileViT's ``B·C·nh``) written -1; None where the
    tensor is read otherwise, or more or other entries change."""
    if len(values) != 2 or values[0].ndim != 1 or not tensor.outputs or any(
            n.op != "Reshape" or n.inputs[1] is not tensor or n.inputs[0] is tensor or n.attrs.get("allowzero", 0)
            for n in tensor.outputs):
        return None
    at1, at2 = values
    changed = np.flatnonzero(at1 != at2)
    if len(changed) != 1 or (at1 == -1).any() or at2[changed[0]] != 2 * at1[changed[0]]:
        return None
    target = at1.astype(np.int64)
    target[changed[0]] = -1
    return target
