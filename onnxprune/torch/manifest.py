"""The kept-channel manifest (``ir.kept.manifest``) on disk, and applied to a user's own ``torch.nn.Module``.

``apply_manifest`` slices the layers a TorchScript export of the module names (Conv1d/2d/3d with groups, Linear,
BatchNorm, LayerNorm, PReLU) and loads the pruned model's weights, so that the module computes what the pruned
ONNX model computes and trains in the user's own loop. Where the export had folded a BatchNorm into a convolution's
weights, the folded weights go into the convolution and the BatchNorm after it becomes ``nn.Identity``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from onnxprune.errors import OnnxPruneError
from onnxprune.fileio import atomic_write
from onnxprune.recovery.train import device_of

Step = Callable[[], None]
LAYERS: dict[str, tuple[type[nn.Module], ...]] = {
    "Conv": (nn.Conv1d, nn.Conv2d, nn.Conv3d), "Gemm": (nn.Linear,), "MatMul": (nn.Linear,),
    "BatchNormalization": (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), "LayerNormalization": (nn.LayerNorm,),
    "PRelu": (nn.PReLU,),
}
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


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
    entries = load_manifest(manifest) if isinstance(manifest, (str, Path)) else manifest
    steps = [_step(module, e) for e in entries]
    steps += _folded_norms(module, entries)
    for step in steps:
        step()
    return module


def _layer(module: nn.Module, entry: dict) -> nn.Module:
    path, node = entry["module"], entry["node"]
    if path is None:
        raise OnnxPruneError(f"node {node!r} names no torch module (its exporter wrote no scopes): apply_manifest "
                             "reads the names of torch.onnx's TorchScript export")
    try:
        layer = module.get_submodule(path)
    except AttributeError as exc:
        raise OnnxPruneError(f"layer {path!r} (node {node!r}) is not in the module: the manifest is of another "
                             "model, or the layer was renamed") from exc
    kinds = LAYERS.get(entry["op"])
    if kinds is None or not isinstance(layer, kinds):
        raise OnnxPruneError(f"layer {path!r} is a {type(layer).__name__}, where the manifest prunes a "
                             f"{entry['op']} node {node!r}")
    shape, held = entry["original_shapes"].get("weight"), getattr(layer, "weight", None)
    if shape is not None and (held is None or held.numel() != int(np.prod(shape)) or
                              not isinstance(layer, nn.PReLU) and list(held.shape) != shape):
        raise OnnxPruneError(f"layer {path!r}: its weight is {None if held is None else list(held.shape)}, the "
                             f"model the manifest was made from had {shape}: other widths")
    return layer


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
