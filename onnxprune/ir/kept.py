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


def parameter_modules(model: onnx.ModelProto) -> dict[str, str]:
    """Per node whose weight is an initializer named as torch names a parameter (``features.0.0.weight``, what the
    dynamo exporter writes, whose node names hold no scope), the module that name is of (``features.0.0``)."""
    inits = {t.name for t in model.graph.initializer}
    return {n.name: n.input[1].removesuffix(".weight") for n in model.graph.node
            if len(n.input) > 1 and n.input[1] in inits and n.input[1].endswith(".weight")}


def _transposed(op: str, attrs: dict[str, int], slot: str) -> bool:
    """Whether torch's module holds the initializer of ``slot`` transposed: a MatMul's [in, out] matrix, and a Gemm's
    without transB, are Linear's [out, in] weight."""
    return slot == "weight" and (op == "MatMul" or (op == "Gemm" and not attrs.get("transB", 0)))


def _weights(model: onnx.ModelProto) -> dict[str, dict]:
    """Per node with ``SLOTS``, its float weights by slot as torch lays them out (``_transposed``); a MatMul's
    ``bias`` is the sum of the constant vectors the Adds right after it, of its module (``module_path``), add
    (torch.onnx writes a Linear on a 3-D input as MatMul then Add, and a refit adds its own), which torch's Linear
    holds in its bias; ``heads``, where a constant Reshape splits the output into heads (``[..., heads, head_dim]``),
    their count and width."""
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    out = {}
    for node in model.graph.node:
        slots = SLOTS.get(node.op_type, ())
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute if a.type == a.INT}
        arrays = {slot: onnx.numpy_helper.to_array(inits[name]) for slot, name in zip(slots, node.input[1:])
                  if name in inits}
        if not arrays:
            continue
        arrays = {slot: a.T if _transposed(node.op_type, attrs, slot) else a for slot, a in arrays.items()}
        tensor = node.output[0]
        while node.op_type == "MatMul" and len(readers.get(tensor, [])) == 1 and readers[tensor][0].op_type == "Add":
            add = readers[tensor][0]
            other = next((inits[i] for i in add.input if i != tensor and i in inits), None)
            if other is None or list(other.dims) != [arrays["weight"].shape[0]] or \
                    module_path(add.name) != module_path(node.name):
                break
            arrays["bias"] = arrays.get("bias", 0) + onnx.numpy_helper.to_array(other)
            tensor = add.output[0]
        projects = node.op_type in ("MatMul", "Gemm") and "weight" in arrays  # a Linear, which may feed heads
        out[node.name] = {"arrays": arrays, "group": attrs.get("group", 1),
                          "heads": _split(readers, inits, tensor, len(arrays["weight"])) if projects else None}
    return out


def _split(readers: dict[str, list[onnx.NodeProto]], inits: dict[str, onnx.TensorProto], tensor: str,
           width: int) -> tuple[int, int] | None:
    """(heads, head width) where a Reshape of constant target ``[..., heads or -1, head width]`` reads ``tensor`` of
    ``width`` channels, else None."""
    targets = [onnx.numpy_helper.to_array(inits[r.input[1]]) for r in readers.get(tensor, [])
               if r.op_type == "Reshape" and len(r.input) > 1 and r.input[1] in inits]
    return next(((width // int(t[-1]), int(t[-1])) for t in targets if t.ndim == 1 and len(t) >= 4 and t[-1] > 0
                 and width % t[-1] == 0 and t[-2] in (-1, width // t[-1])), None)


def _heads(split: tuple[int, int], width: int) -> list[int] | None:
    """An attention projection's head count in the original (``width`` channels in heads as wide as now) and now
    (``split``: ``_split``'s); None where their count did not change."""
    if width % split[1] or width // split[1] == split[0]:
        return None
    return [width // split[1], split[0]]


def _pieces(model: onnx.ModelProto) -> dict[str, list[int]]:
    """Per Split node whose piece sizes are constant (its ``split`` input, from an initializer or a Constant node,
    or attribute), those sizes."""
    values = {t.name: t for t in model.graph.initializer}
    values.update({n.output[0]: a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute
                   if a.name == "value"})
    out = {}
    for node in model.graph.node:
        if node.op_type != "Split":
            continue
        if len(node.input) > 1 and node.input[1] in values:
            out[node.name] = [int(v) for v in onnx.numpy_helper.to_array(values[node.input[1]]).reshape(-1)]
        for a in node.attribute:
            if a.name == "split":
                out[node.name] = [int(v) for v in a.ints]
    return out


def manifest(original: onnx.ModelProto, pruned: onnx.ModelProto) -> list[dict]:
    """Per node of ``pruned`` whose weights differ from ``original``'s (narrowed or refit): its name, op type, the
    torch module path a TorchScript export gives it (``module_path``; else the one its weight's name gives,
    ``parameter_modules``), the original channels its output and its input
    hold (``read_kept``; None where all), its ``group`` count, and its float weights as torch lays them out
    (``SLOTS``, ``_weights``), with their shapes in ``original``, whether a BatchNormalization node reads its
    output (else an exporter may have folded the module's norm into these weights), and the head counts before and
    after of an attention projection (else None). A Split whose pieces changed is listed with its ``pieces`` before
    and after (a module that cuts a tensor in pieces must cut it as the pruned model does)."""
    kept = read_kept(pruned)
    named = parameter_modules(original)
    normed = {i for n in pruned.graph.node if n.op_type == "BatchNormalization" for i in n.input[:1]}
    old, new = _weights(original), _weights(pruned)
    entries = []
    for node in pruned.graph.node:
        if node.name not in new or node.name not in old:
            continue
        arrays, before = new[node.name]["arrays"], old[node.name]["arrays"]
        if all(slot in before and np.array_equal(a, before[slot]) for slot, a in arrays.items()):
            continue
        channels = {side: kept[tensor][1].tolist() if tensor in kept else None
                    for side, tensor in (("out_channels", node.output[0]), ("in_channels", node.input[0]))}
        entries.append({"node": node.name, "op": node.op_type, "module": module_path(node.name) or named.get(node.name),
                        **channels,
                        "groups": new[node.name]["group"], "norm_in_graph": node.output[0] in normed,
                        "heads": new[node.name]["heads"] and _heads(new[node.name]["heads"], len(before["weight"])),
                        "original_shapes": {s: list(before[s].shape) if s in before else None for s in arrays},
                        "weights": arrays})
    before, after = _pieces(original), _pieces(pruned)
    entries += [{"node": name, "op": "Split", "module": module_path(name), "out_channels": None, "in_channels": None,
                 "pieces": [before[name], pieces], "weights": {}}
                for name, pieces in after.items() if name in before and before[name] != pieces]
    return entries
