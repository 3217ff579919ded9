"""Pre-flight: every candidate group pruned at once, in a copy, and run by onnxruntime on one sample, in seconds
and before any statistic is gathered.

The weights after slicing are arbitrary (the original's rows and columns, unrefitted): what is checked is that
the pruned graph still loads and runs, and that its outputs keep their shapes. On a failure the groups
responsible are isolated by halving the set (a failure that needs several groups together is traced by the
shortest failing prefix) and excluded, each with the reason in words: the node onnxruntime names and what it
says. So a registry rule that is wrong for an unseen export costs one group, found in seconds, instead of a
refusal of the written model after the whole run. The written-model check stays as the last guard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs

from onnxprune.analysis.groups import Group
from onnxprune.ir.graph import export_model, static_shape
from onnxprune.ir.ort import make_session, ort_failure
from onnxprune.ir.probe import random_feed, real_inputs
from onnxprune.passes import slice_channels
from onnxprune.tasks import image_hw, infer_task

SECONDS = 60.0  # isolating culprits stops here: the groups still suspected are excluded together (and said so)


@dataclass
class Preflight:
    """What the pre-flight found: the groups it pruned together, those it excluded (name -> reason), how many
    onnxruntime runs and seconds it took, and why it did not run, where it did not."""

    groups: int = 0
    excluded: dict[str, str] = field(default_factory=dict)
    trials: int = 0
    seconds: float = 0.0
    not_run: str | None = None
    task: str | None = None  # what the original's outputs on the sample show (``tasks.infer_task``), where it ran

    def to_dict(self) -> dict:
        return asdict(self)


def preflight(graph: gs.Graph, groups: Sequence[Group], seconds: float = SECONDS,
              on_status: Callable[[str], None] | None = None) -> Preflight:
    """Prune ``groups`` of ``graph`` together in a copy (every other channel kept) and run the copy on one random
    sample; exclude (add a blocker to) each group the failing runs trace back to. ``graph`` is not changed."""
    start = time.perf_counter()
    result = Preflight(groups=len(groups))
    model = export_model(graph.copy())
    inputs = real_inputs(model)
    if any(d.dim_value <= 0 for v in inputs for d in v.type.tensor_type.shape.dim[1:]):
        result.not_run = "an input has dynamic dims past the batch: give --input-shape"
        return result
    feed = random_feed(inputs, batch=1 if any(v.type.tensor_type.shape.dim[0].dim_value <= 0 for v in inputs)
                       else None)
    try:
        reference = _run(model, feed)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own errors: the original itself does not run here
        result.not_run = f"the original model does not run on a random sample ({ort_failure(exc)[1]})"
        return result
    first = next(iter(feed.values()))
    result.task = infer_task(reference, image_hw(first), len(first)).name
    declared = [static_shape(t) for t in graph.outputs]

    def trial(subset: Sequence[Group]) -> str | None:
        result.trials += 1
        if on_status is not None and result.trials > 1:  # the first run takes a second; isolating may take more
            on_status(f"pre-flight: isolating the groups that break onnxruntime, run {result.trials} "
                      f"({len(subset)} pruned together)")
        return _trial(graph, subset, feed, reference, declared)

    deadline = time.monotonic() + seconds
    candidates = list(groups)
    why = trial(candidates) if candidates else None
    while why is not None:
        found = _halve(trial, candidates, why, deadline, seconds) or _prefix(trial, candidates, why)
        for group, reason in found:
            group.blockers.append(f"pre-flight: {reason}")
            result.excluded[group.name] = reason
        candidates = [g for g in candidates if g.name not in result.excluded]
        why = trial(candidates) if candidates else None
    result.seconds = time.perf_counter() - start
    return result


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session, _ = make_session(model, "cpu", quiet=True, arena=False, prepack=False)
    return session.run(None, feed)


def _trial(graph: gs.Graph, subset: Sequence[Group], feed: dict[str, np.ndarray], reference: list[np.ndarray],
           declared: list[list[int | None] | None]) -> str | None:
    """Why ``graph`` with ``subset`` pruned fails (None: it runs, its outputs shaped as ``reference`` where their
    declared shape is static)."""
    copy = graph.copy()
    try:
        for group in subset:
            copy = slice_channels(copy, group, np.arange(0, group.channels, 2))
        model = export_model(copy)
    except Exception as exc:  # noqa: BLE001 - a pass that cannot slice this graph is the finding itself
        return f"the slicing pass fails on it ({type(exc).__name__}: {exc})"
    try:
        outputs = _run(model, feed)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's errors are plain RuntimeErrors of many kinds
        node, words = ort_failure(exc)
        return f"pruned, the model fails in onnxruntime at {f'node {node}' if node else 'a node it does not name'}: " \
               f"{words}"
    for tensor, out, ref, shape in zip(graph.outputs, outputs, reference, declared):
        fixed = [i for i, d in enumerate(shape or []) if isinstance(d, int)]
        if out.ndim != ref.ndim or any(out.shape[i] != ref.shape[i] for i in fixed if i < out.ndim):
            return f"pruned, the model's output {tensor.name} changes shape from {list(ref.shape)} to {list(out.shape)}"
    return None


def _halve(trial: Callable[[Sequence[Group]], str | None], subset: list[Group], why: str, deadline: float,
           seconds: float) -> list[tuple[Group, str]]:
    """The groups of failing ``subset`` that fail alone, found by halving (empty where only several together
    fail). Past ``deadline`` a failing subset is blamed whole."""
    if len(subset) == 1:
        return [(subset[0], why)]
    if time.monotonic() > deadline:
        note = f" (one of {len(subset)} groups pruned together; isolating it took over {seconds:.0f} s)"
        return [(g, why + note) for g in subset]
    found = []
    for half in (subset[: len(subset) // 2], subset[len(subset) // 2:]):
        reason = trial(half)
        if reason is not None:
            found += _halve(trial, half, reason, deadline, seconds)
    return found


def _prefix(trial: Callable[[Sequence[Group]], str | None], subset: list[Group], why: str
            ) -> list[tuple[Group, str]]:
    """The group whose addition makes the shortest failing prefix of ``subset`` fail (a failure that needs
    several groups pruned together), by bisection."""
    lo, hi, reason = 1, len(subset), why  # the prefix of length hi fails, of length lo - 1 runs
    while lo < hi:
        mid = (lo + hi) // 2
        failed = trial(subset[:mid])
        if failed is None:
            lo = mid + 1
        else:
            hi, reason = mid, failed
    return [(subset[hi - 1], reason)]
