"""Which of the original model's channels a pruned model's tensors hold, kept in the model's metadata.

``compress`` writes, for every tensor it narrowed, the axis and the original indices still there (in order): the
pruned tensor stands for ``take(original, indices, axis)``, what a tool comparing the two (or a user mapping
channels back) needs."""

from __future__ import annotations

import json

import numpy as np
import onnx

KEY = "onnxprune.kept"

Kept = dict[str, tuple[int, np.ndarray]]  # tensor name -> (channel axis, the original indices it holds)


def narrow(kept: Kept, entries: dict[str, np.ndarray], axes: dict[str, int]) -> None:
    """Record in ``kept`` that each tensor of ``entries`` now holds only the given indices of its current channels
    along ``axes[name]`` (indices of what it held before, composed with what was recorded then)."""
    for name, index in entries.items():
        axis = axes[name]
        before = kept.get(name)
        kept[name] = (axis, np.asarray(index, np.int64) if before is None else before[1][index])


def _runs(index: np.ndarray) -> str:
    """``index`` as runs of consecutive integers: "0-3,7,9-10"."""
    parts, start = [], 0
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            a, b = int(index[start]), int(index[i - 1])
            parts.append(str(a) if a == b else f"{a}-{b}")
            start = i
    return ",".join(parts)


def _indices(runs: str) -> np.ndarray:
    out: list[int] = []
    for part in filter(None, runs.split(",")):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return np.asarray(out, np.int64)


def write_kept(model: onnx.ModelProto, kept: Kept) -> onnx.ModelProto:
    """``model`` with ``kept`` in its metadata (replacing any); mutated in place and returned."""
    props = [p for p in model.metadata_props if p.key != KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(props)
    if kept:
        value = json.dumps({name: [axis, _runs(index)] for name, (axis, index) in sorted(kept.items())})
        model.metadata_props.add(key=KEY, value=value)
    return model


def read_kept(model: onnx.ModelProto) -> Kept:
    """The map ``write_kept`` stored in ``model`` (empty when there is none)."""
    for prop in model.metadata_props:
        if prop.key == KEY:
            return {name: (int(axis), _indices(runs)) for name, (axis, runs) in json.loads(prop.value).items()}
    return {}


# the torch parameter each float input slot of a node type holds (what ``manifest`` names its weights by)
SLOTS = {"Conv": ("weight", "bias"), "ConvTranspose": ("weight", "bias"), "Gemm": ("weight", "bias"),
         "MatMul": ("weight",), "BatchNormalization": ("weight", "bias", "running_mean", "running_var"),
         "LayerNormalization": ("weight", "bias"), "PRelu": ("weight",)}


def module_path(node: str) -> str | None:
    """The torch module a TorchScript export's node name stands for (``/features/features.3/conv/conv.0/conv.0.0/Conv``
    → ``features.3.conv.0.0``: each scope is its module's attribute, prefixed by its container's scope), None where
    the name holds no scope (another exporter's naming)."""
    scopes = node.split("/")[1:-1]
    if not node.startswith("/") or not scopes:
        return None
    parts, previous = [], ""
    for scope in scopes:
        parts.append(scope[len(previous) + 1:] if previous and scope.startswith(previous + ".") else scope)
        previous = scope
    return ".".join(parts)


def _transposed(op: str, attrs: dict[str, int], slot: str) -> bool:
    """Whether torch's module holds the initializer of ``slot`` transposed: a MatMul's [in, out] matrix, and a Gemm's
    without transB, are Linear's [out, in] weight."""
    return slot == "weight" and (op == "MatMul" or (op == "Gemm" and not attrs.get("transB", 0)))


def manifest(original: onnx.ModelProto, pruned: onnx.ModelProto) -> list[dict]:
    """Per node of ``pruned`` whose weights differ from ``original``'s (narrowed or refit): its name, op type, the
    torch module path a TorchScript export gives it (``module_path``), the original channels its output and its input
    hold (``read_kept``; None where all), its ``group`` count, and its float weights as torch lays them out
    (``SLOTS``), with their shapes in ``original``, and whether a BatchNormalization node reads its output (else an
    exporter may have folded the module's norm into these weights)."""
    kept = read_kept(pruned)
    normed = {i for n in pruned.graph.node if n.op_type == "BatchNormalization" for i in n.input[:1]}
    old_nodes = {n.name: n for n in original.graph.node}
    old_weights = {t.name: t for t in original.graph.initializer}
    new_weights = {t.name: t for t in pruned.graph.initializer}
    entries = []
    for node in pruned.graph.node:
        slots = SLOTS.get(node.op_type, ())
        reads = [(slot, name) for slot, name in zip(slots, node.input[1:]) if name in new_weights]
        before = old_nodes.get(node.name)
        if not reads or before is None:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.type == a.INT}
        old = dict(zip(slots, (old_weights.get(name) for name in before.input[1:])))
        arrays = {slot: onnx.numpy_helper.to_array(new_weights[name]) for slot, name in reads}
        if all(old.get(slot) is not None and np.array_equal(a, onnx.numpy_helper.to_array(old[slot]))
               for slot, a in arrays.items()):
            continue
        channels = {side: kept[tensor][1].tolist() if tensor in kept else None
                    for side, tensor in (("out_channels", node.output[0]), ("in_channels", node.input[0]))}
        flip = {slot: _transposed(node.op_type, attrs, slot) for slot in arrays}
        entries.append({"node": node.name, "op": node.op_type, "module": module_path(node.name), **channels,
                        "groups": attrs.get("group", 1), "norm_in_graph": node.output[0] in normed,
                        "original_shapes": {s: None if old.get(s) is None else
                                            list(old[s].dims)[::-1] if flip[s] else list(old[s].dims) for s in arrays},
                        "weights": {s: a.T if flip[s] else a for s, a in arrays.items()}})
    return entries
