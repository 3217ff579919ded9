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
