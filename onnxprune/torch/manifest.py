"""The kept-channel manifest: built from the original and the pruned model (``manifest``), on disk, and applied to a
user's own ``torch.nn.Module``.

``apply_manifest`` slices the layers a TorchScript export of the module names (Conv1d/2d/3d with groups, Linear,
BatchNorm, LayerNorm, PReLU; an attention's projections by whole heads, its head count with them) and loads the
pruned model's weights, so that the module computes what the pruned
ONNX model computes and trains in the user's own loop. Where the export had folded a BatchNorm into a convolution's
weights, the folded weights go into the convolution and the BatchNorm after it becomes ``nn.Identity``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from onnxprune.errors import OnnxPruneError
from onnxprune.fileio import atomic_write
from onnxprune.ir.kept import read_kept
from onnxprune.ops.registry import lookup
from onnxprune.torch.engine import device_of

Step = Callable[[], None]
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_heads", "heads")  # what attention modules count heads by
HEAD_WIDTHS = ("all_head_size", "inner_dim")  # and what some keep the heads' total width in
PIECE_WIDTHS = ("c",)  # what a block that cuts a tensor in equal pieces keeps a piece's width in (Ultralytics' C2f)
QKV = ".q", ".k", ".v"  # the nodes the load splits a fused projection into (``normal.split_qkv``), in torch's order


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
    """Per node whose op names its torch layer's parameters (``OpEntry.layer``), its float weights by slot as torch
    lays them out (``_transposed``); a MatMul's ``bias`` is the sum of the constant vectors the Adds right after it,
    of its module (``module_path``), add (torch.onnx writes a Linear on a 3-D input as MatMul then Add, and a refit
    adds its own), which torch's Linear holds in its bias; ``heads``, where a constant Reshape splits the output into
    heads (``[..., heads, head_dim]``), their count and width."""
    inits = {t.name: t for t in model.graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for name in n.input:
            readers.setdefault(name, []).append(n)
    out = {}
    for node in model.graph.node:
        entry = lookup(node.op_type)
        slots = entry.layer.slots if entry is not None and entry.layer is not None else ()
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


def _pieces(model: onnx.ModelProto) -> dict[str, list[int] | None]:
    """Per Split node, its piece sizes where they are constant (its ``split`` input, from an initializer or a Constant
    node, or attribute); None where it cuts equal pieces (``num_outputs``, or no sizes)."""
    values = {t.name: t for t in model.graph.initializer}
    values.update({n.output[0]: a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute
                   if a.name == "value"})
    out = {}
    for node in model.graph.node:
        if node.op_type != "Split":
            continue
        out[node.name] = None
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
    (``OpEntry.layer``, ``_weights``), with their shapes in ``original``, whether a BatchNormalization node reads its
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
    cut_before, cut_after = _pieces(original), _pieces(pruned)
    entries += [{"node": name, "op": "Split", "module": module_path(name), "out_channels": None, "in_channels": None,
                 "pieces": [cut_before[name], pieces], "weights": {}} for name, pieces in cut_after.items()
                if name in cut_before and pieces is not None and cut_before[name] != pieces]
    return entries


def save_manifest(entries: list[dict], path: str | Path) -> Path:
    """``entries`` as JSON at ``path`` (indices, module paths, shapes) and their weights in the ``.npz`` beside it,
    each written atomically; the JSON names each weight's key there."""
    path = Path(path)
    arrays = {f"{i}.{slot}": value for i, e in enumerate(entries) for slot, value in e["weights"].items()}
    listed = [{**e, "weights": {slot: f"{i}.{slot}" for slot in e["weights"]}} for i, e in enumerate(entries)]
    weights = path.with_suffix(".npz")
    atomic_write(weights, lambda tmp: np.savez(tmp.open("wb"), **arrays))
    text = json.dumps({"weights": weights.name, "nodes": listed}, indent=1)
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def load_manifest(path: str | Path) -> list[dict]:
    """What ``save_manifest`` wrote: the entries with their weights as arrays."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        with np.load(path.parent / data["weights"]) as arrays:
            return [{**e, "weights": {slot: arrays[key] for slot, key in e["weights"].items()}}
                    for e in data["nodes"]]
    except (OSError, KeyError, ValueError) as exc:
        raise OnnxPruneError(f"{path}: not a manifest compress --manifest wrote, or its .npz is missing ({exc})") \
            from exc


def apply_manifest(module: nn.Module, manifest: list[dict] | str | Path) -> nn.Module:
    """Slice ``module``'s layers in place as the manifest (a list, or a file ``save_manifest`` wrote) says and load
    the pruned model's weights; returns the module. Every layer is checked before any changes: a layer the module
    lacks (renamed), of another kind or of other widths than the model the manifest was made from raises one
    OnnxPruneError naming it, and the module is left unchanged."""
    entries = _fused(load_manifest(manifest) if isinstance(manifest, (str, Path)) else manifest)
    steps = [_step(module, e) for e in entries if e["op"] != "Split"]
    steps += _folded_norms(module, entries) + _head_counts(module, entries) + _split_widths(module, entries)
    for step in steps:
        step()
    return module


def _layer(module: nn.Module, entry: dict) -> nn.Module:
    path, node = entry["module"], entry["node"]
    if path is None:
        raise OnnxPruneError(f"node {node!r} names no torch module (its exporter wrote no scopes): apply_manifest "
                             "reads the names of torch.onnx's TorchScript export")
    layer = _submodule(module, path, node)
    op = lookup(entry["op"])
    if op is None or op.layer is None or not isinstance(layer, op.layer.modules):
        raise OnnxPruneError(f"layer {path!r} is a {type(layer).__name__}, where the manifest prunes a "
                             f"{entry['op']} node {node!r}")
    shape, held = entry["original_shapes"].get("weight"), getattr(layer, "weight", None)
    if shape is not None and (held is None or held.numel() != int(np.prod(shape)) or
                              not isinstance(layer, nn.PReLU) and list(held.shape) != shape):
        raise OnnxPruneError(f"layer {path!r}: its weight is {None if held is None else list(held.shape)}, the "
                             f"model the manifest was made from had {shape}: other widths")
    return layer


def _submodule(module: nn.Module, path: str, node: str) -> nn.Module:
    """``module``'s submodule ``path`` (where the manifest's ``node`` came from), or an OnnxPruneError naming both."""
    try:
        return module.get_submodule(path)
    except AttributeError as exc:
        raise OnnxPruneError(f"layer {path!r} (node {node!r}) is not in the module: the manifest is of another "
                             "model, or the layer was renamed") from exc


def _step(module: nn.Module, entry: dict) -> Step:
    """The change ``entry`` makes to its layer, checked now, made when called."""
    layer = _layer(module, entry)
    w = {slot: torch.from_numpy(np.array(a, dtype=np.float32)) for slot, a in entry["weights"].items()}

    def load(**sizes: object) -> None:
        for name, value in sizes.items():
            setattr(layer, name, value)
        for slot, value in w.items():
            old = getattr(layer, slot, None)
            value = value.reshape(-1) if isinstance(layer, nn.PReLU) else value
            if isinstance(old, nn.Parameter) or old is None and slot in ("weight", "bias"):
                setattr(layer, slot, nn.Parameter(value.to(device_of(layer)), requires_grad=True))
            else:
                setattr(layer, slot, value.to(device_of(layer)))
        if entry["op"] in ("Conv", "Gemm", "MatMul") and "bias" not in w and getattr(layer, "bias", None) is not None:
            layer.bias = None  # the exported layer has none

    op, weight = entry["op"], w.get("weight")
    if op == "Conv":
        groups = entry["groups"]
        return lambda: load(out_channels=weight.shape[0], in_channels=weight.shape[1] * groups, groups=groups)
    if op in ("Gemm", "MatMul"):
        return lambda: load(out_features=weight.shape[0], in_features=weight.shape[1])
    if op == "BatchNormalization":
        return lambda: load(num_features=len(w["running_mean"]))
    if op == "LayerNormalization":
        return lambda: load(normalized_shape=tuple(weight.shape))
    return lambda: load(num_parameters=weight.numel())


def _folded_norms(module: nn.Module, entries: list[dict]) -> list[Step]:
    """For each convolution whose export had no BatchNormalization node after it, the BatchNorm registered right
    after it in its parent (a Conv-BN-activation block; a ResNet block's conv1, bn1), if any, replaced by
    ``nn.Identity``: the convolution's new weights hold it."""
    steps = []
    named = {e["module"] for e in entries}
    for e in entries:
        if e["op"] != "Conv" or e["norm_in_graph"]:
            continue
        parent_path, _, name = e["module"].rpartition(".")
        parent = module.get_submodule(parent_path)
        children = list(parent.named_children())
        after = next((children[i + 1] for i, (n, _) in enumerate(children[:-1]) if n == name), None)
        if after is None or not isinstance(after[1], NORMS) or f"{parent_path}.{after[0]}".lstrip(".") in named:
            continue
        original = (e["original_shapes"].get("weight") or [None])[0]
        if after[1].num_features != original:
            raise OnnxPruneError(f"layer {e['module']!r} is followed by {after[0]!r}, a BatchNorm of "
                                 f"{after[1].num_features} features, where the model had {original} channels")
        steps.append(lambda parent=parent, child=after[0]: setattr(parent, child, nn.Identity()))
    return steps


def _fused(entries: list[dict]) -> list[dict]:
    """``entries`` with the q, k and v projections that the load split one fused projection into (nodes ``<name>.q``,
    ``.k``, ``.v`` of one module) merged back into one entry, as the module holds them: the weights stacked."""
    parts: dict[str, dict[str, dict]] = {}
    for e in entries:
        if e["op"] in ("Gemm", "MatMul") and e["node"].endswith(QKV):
            parts.setdefault(e["node"][:-2], {})[e["node"][-2:]] = e
    if not parts:
        return entries
    merged = {}
    for base, part in parts.items():
        if len(part) < 3 or len({p["weights"]["weight"].shape[0] for p in part.values()}) > 1:
            widths = ", ".join(f"{k[1]}: {e['weights']['weight'].shape[0]}" for k, e in sorted(part.items()))
            raise OnnxPruneError(f"node {base!r}: a fused q/k/v projection whose parts were pruned apart ({widths} "
                                 "channels): its module holds three equal parts")
        q, k, v = (part[x] for x in QKV)
        slots = [s for s in q["weights"] if all(s in p["weights"] for p in (k, v))]
        rows = [p["original_shapes"]["weight"][0] for p in (q, k, v)]
        kept = [None if p["out_channels"] is None else [c + sum(rows[:i]) for c in p["out_channels"]]
                for i, p in enumerate((q, k, v))]
        merged[id(q)] = {**q, "node": base, "parts": 3,
                         "out_channels": None if None in kept else kept[0] + kept[1] + kept[2],
                         "original_shapes": {s: [sum(p["original_shapes"][s][0] for p in (q, k, v)),
                                                 *q["original_shapes"][s][1:]] for s in slots},
                         "weights": {s: np.concatenate([p["weights"][s] for p in (q, k, v)]) for s in slots}}
    dropped = {id(part[x]) for part in parts.values() for x in (".k", ".v")}
    return [merged.get(id(e), e) for e in entries if id(e) not in dropped]


def _head_counts(module: nn.Module, entries: list[dict]) -> list[Step]:
    """For each attention projection that lost heads, its parent's head count (``HEAD_COUNTS``, the attribute equal
    to the count before) and total width (``HEAD_WIDTHS``) set to what is left; an OnnxPruneError where the parent
    holds no such count, as the module would then split its projections into heads of other widths."""
    changes: dict[tuple[str, str], object] = {}
    for e in entries:
        if not e.get("heads"):
            continue
        before, after = e["heads"]
        parent_path = e["module"].rpartition(".")[0]
        parent = module.get_submodule(parent_path)
        count = next((a for a in HEAD_COUNTS if getattr(parent, a, None) == before), None)
        if count is None:
            raise OnnxPruneError(f"layer {e['module']!r} keeps {after} of {before} heads, but "
                                 f"{parent_path or 'the module'!r} has no head count ({', '.join(HEAD_COUNTS)}) "
                                 f"of {before}: set it to {after} after apply_manifest, or name it so")
        changes[parent_path, count] = after
        width = e["original_shapes"]["weight"][0] // before // e.get("parts", 1)  # a head's, in each of q, k, v
        for a in HEAD_WIDTHS:
            if isinstance(getattr(parent, a, None), int) and getattr(parent, a) == before * width:
                changes[parent_path, a] = after * width
    return [lambda p=p, a=a, v=v: setattr(module.get_submodule(p), a, v) for (p, a), v in changes.items()]


def _split_widths(module: nn.Module, entries: list[dict]) -> list[Step]:
    """For each Split whose equal pieces stay equal, the piece width its module keeps (``PIECE_WIDTHS``, the
    attribute equal to the width before) set to what is left; an OnnxPruneError where the pieces were pruned apart
    (a module cuts a tensor in pieces by code, not by the widths of its layers, and cannot follow)."""
    steps = []
    for e in entries:
        if e["op"] != "Split":
            continue
        (before, after), where = e["pieces"], e["module"] or e["node"]
        if before is not None and len(set(before)) > 1 or len(set(after)) > 1:
            raise OnnxPruneError(
                f"layer {where!r} cuts a tensor in {'equal pieces' if before is None else f'pieces of {before} channels'}"
                f", the pruned model in pieces of {after}: the module "
                "cannot follow (its code cuts the pieces); export the block with one convolution per piece (as "
                "Torch-Pruning's C2f_v2 does for Ultralytics' C2f) and prune that export")
        block = _submodule(module, e["module"], e["node"]) if e["module"] else None
        steps += [lambda b=block, a=a, v=after[0]: setattr(b, a, v) for a in PIECE_WIDTHS
                  if block is not None and before is not None and getattr(block, a, None) == before[0]]
    return steps
