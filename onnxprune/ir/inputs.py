"""Input shapes: ``--input-shape`` text, a static shape for every input, and a model with them written in."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

import onnx

from onnxprune.errors import OnnxPruneError
from onnxprune.ir.ort import InputSpec, model_input_specs


ShapeMap = dict[str | None, list[int]]


SHAPE_FORMS = "use NxCxHxW for the single input (e.g. 1x3x224x224) or NAME:NxCxHxW per input (e.g. images:1x3x320x320)"


_DIMS = re.compile(r"^\d+([x,]\d+)*$")


def parse_input_shapes(specs: Iterable[str] | None) -> ShapeMap:
    """``["1x3x224x224"]`` → ``{None: [1, 3, 224, 224]}``; ``["a:1x3x8x8", "b:1x4"]`` → per-input shapes.

    An unnamed shape applies to the model's single input; several inputs need a named shape each.
    """
    shapes: ShapeMap = {}
    for spec in specs or []:
        text = spec.strip()
        name, sep, dims = text.rpartition(":")
        key = name.strip() if sep else None
        dims = dims.strip().lower()
        if (sep and not key) or not _DIMS.match(dims):
            raise OnnxPruneError(f"input shape {spec!r} is not a shape: {SHAPE_FORMS}", option="input_shape")
        values = [int(d) for d in re.split(r"[x,]", dims)]
        if any(v <= 0 for v in values):
            raise OnnxPruneError(f"input shape {spec!r} has a zero dimension: every dimension must be >= 1",
                                 option="input_shape")
        if key in shapes:
            what = f"input {key!r}" if key else "the unnamed input"
            raise OnnxPruneError(f"the input shapes give {what} twice: give each input's shape once",
                                 option="input_shape")
        shapes[key] = values
    if None in shapes and len(shapes) > 1:
        raise OnnxPruneError("the input shapes mix an unnamed shape with named ones: with several inputs, "
                             "name each one (NAME:NxCxHxW)", option="input_shape")
    return shapes


def _as_shape_map(input_shapes: Mapping[str | None, Sequence[int]] | Iterable[str] | None) -> ShapeMap:
    """Accept a parsed shape map or the raw ``--input-shape`` strings."""
    if input_shapes is None:
        return {}
    if isinstance(input_shapes, Mapping):
        return {k: [int(d) for d in v] for k, v in input_shapes.items()}
    if isinstance(input_shapes, str):
        input_shapes = [input_shapes]
    return parse_input_shapes(list(input_shapes))


def resolve_input_shapes(
    specs: list[InputSpec],
    input_shapes: Mapping[str | None, Sequence[int]] | Iterable[str] | None,
    batch: int | None,
    source: str,
) -> dict[str, list[int]]:
    """A fully static shape for every model input.

    A dynamic first (batch) dim becomes ``batch`` (or, with ``batch=None``, the ``input_shapes`` value,
    else 1); every other dynamic dim must come from ``input_shapes``. Errors name ``source``, the input
    and the dim.
    """
    given = _as_shape_map(input_shapes)
    names = [name for name, _, _ in specs]
    unknown = [k for k in given if k is not None and k not in names]
    if unknown:
        raise OnnxPruneError(f"{source}: the input shapes name {', '.join(map(repr, unknown))}, which the model "
                             f"does not have: its inputs are {', '.join(map(repr, names))}", option="input_shape")
    if None in given and len(specs) != 1:
        raise OnnxPruneError(f"{source}: an unnamed input shape needs a single-input model, but it has inputs "
                             f"{', '.join(map(repr, names))}: use NAME:NxCxHxW for each", option="input_shape")
    shapes: dict[str, list[int]] = {}
    for name, dims, _ in specs:
        want = given.get(name, given.get(None))
        if want is not None and len(want) != len(dims):
            raise OnnxPruneError(f"{source}: the input shape for input {name!r} has {len(want)} dims but the "
                                 f"input has {len(dims)} ({_show(dims)}): give all {len(dims)} dims",
                                 option="input_shape")
        shape = []
        for axis, dim in enumerate(dims):
            static = isinstance(dim, int) and dim > 0
            if axis == 0 and batch is not None:
                if static and dim != batch:
                    raise OnnxPruneError(
                        f"{source}: input {name!r} has a static batch size of {dim} but the batch is {batch}: "
                        f"use batch {dim}, or re-export the model with a dynamic batch dimension", option="batch")
                if want is not None and want[0] != batch:
                    raise OnnxPruneError(
                        f"{source}: the input shape sets the batch dim of input {name!r} to {want[0]} but the "
                        f"batch is {batch}: make them agree (e.g. batch {want[0]})", option="batch")
                shape.append(batch)
            elif static:
                if want is not None and want[axis] != dim:
                    raise OnnxPruneError(
                        f"{source}: the input shape gives dim {axis} of input {name!r} as {want[axis]} but the "
                        f"model fixes it to {dim} ({_show(dims)}): use {dim} there", option="input_shape")
                shape.append(dim)
            elif want is not None:
                shape.append(want[axis])
            elif axis == 0:
                shape.append(1)
            else:
                label = f" ({dim!r})" if isinstance(dim, str) else ""
                raise OnnxPruneError(
                    f"{source}: input {name!r} {_show(dims)} has a dynamic dim {axis}{label} that needs a value: "
                    f"give its input shape, e.g. {name}:{'x'.join(str(d) for d in _example(dims, batch))}",
                    option="input_shape")
        shapes[name] = shape
    return shapes


def _show(dims: Sequence[int | str | None]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def _example(dims: Sequence[int | str | None], batch: int | None) -> list[int | str]:
    """An example shape for an error message: static dims kept, the batch filled, others as placeholders."""
    out: list[int | str] = []
    for axis, d in enumerate(dims):
        if isinstance(d, int) and d > 0:
            out.append(d)
        elif axis == 0:
            out.append(batch or 1)
        else:
            out.append(f"<{d or f'dim{axis}'}>")
    return out


def fix_input_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]], keep_batch: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs have the given static shapes (intermediate shapes cleared).

    With ``keep_batch`` an input's dynamic first (batch) dim stays as it is, and so do the output dims
    named by the same symbols; the outputs' other dims are left to shape inference."""
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    kept: set[str] = set()
    for value in fixed.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            batch = onnx.TensorShapeProto.Dimension()
            if dims:
                batch.CopyFrom(dims[0])
            del dims[:]
            for d in shapes[value.name]:
                dims.add().dim_value = int(d)
            if keep_batch and dims and batch.dim_value <= 0:
                dims[0].CopyFrom(batch)
                if not batch.dim_param:  # unknown, or -1 as Paddle exports write it
                    dims[0].dim_param = "N"
                kept.add(dims[0].dim_param)
    del fixed.graph.value_info[:]
    for value in fixed.graph.output:
        if value.type.HasField("tensor_type"):
            if not keep_batch:
                value.type.tensor_type.ClearField("shape")
                continue
            for d in value.type.tensor_type.shape.dim:
                if not d.HasField("dim_value") and not (d.dim_param and d.dim_param in kept):
                    d.Clear()
    return fixed


def specialise_inputs(
    model: onnx.ModelProto, input_shapes: Mapping[str | None, Sequence[int]] | Iterable[str] | None, source: str
) -> onnx.ModelProto:
    """``model`` with every dynamic non-batch input dim fixed from ``input_shapes`` (``--input-shape``).

    The analysis needs static shapes apart from the batch dim, which stays as it is (dynamic or not).
    Returns ``model`` itself when no dim changes; a dynamic non-batch dim without a value is a one-line
    OnnxPruneError naming the input and the ``--input-shape`` to pass."""
    specs = model_input_specs(model)
    shapes = resolve_input_shapes(specs, input_shapes, None, source)
    if all(isinstance(d, int) and d > 0 for _, dims, _ in specs for d in dims[1:]):
        return model
    return fix_input_shapes(model, shapes, keep_batch=True)
