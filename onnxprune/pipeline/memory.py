"""The run's memory, planned before any work and measured after: what each phase holds, fitted to what is available.

A run holds, besides the process itself: the cached tensors of both networks at the widest cut for every sample
(the store's budget, spilled to disk past it), onnxruntime's activations for one batch of samples, a statistics
chunk (a consumer's unfolded inputs and targets), the network's outputs for every sample (the objective's
reference) and a few copies of the weights (the original, the pruned graph, a probe's copy). ``plan`` estimates
each from the graph's static shapes and, where their sum would not fit in the memory available, lowers the
store's budget (more spills to disk), then the batch onnxruntime runs at, then the statistics chunk, and says
which. The report records the plan and the peak resident memory the run reached.
"""

from __future__ import annotations

import math
import resource
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis import Analysis
from onnxprune.analysis.groups import Group
from onnxprune.core.statistics import STATS_BYTES
from onnxprune.ir.graph import static_shape
from onnxprune.ops.registry import lookup
from onnxprune.ir.cuts import Liveness
from onnxprune.ir.store import available_memory, show_bytes

FIT = 0.85  # of the memory available at the start, what the plan lets the run grow by
MIN_STATS_BYTES = 64 << 20
RUN_BYTES = 32 << 20
"""Activations of one onnxruntime run on the CPU: the largest power-of-two batch within them, at least 2 (a batch of 1
hides which axis holds the samples). Measured on 64 samples, 2 cores: batch 32 against this one, MobileNetV2
0.32-0.35 s against 0.14-0.17 s (batch 2), PicoDet at 800x608 6.7 s against 3.8 s (2), YOLOX at 416 1.45-1.63 s
against 1.04-1.07 s (2), YOLOv8n at 320 0.64 s against 0.47 s (4), ResNet-34 1.05 s against 1.01 s (4)."""


@dataclass
class MemoryPlan:
    """What the run may hold: the store's budget, onnxruntime's batch, a statistics chunk; what it expects to
    reach (``estimate``, bytes beyond the process as it was), its parts, what was lowered to fit, the peak RSS."""

    available: int
    budget: int
    run_batch: int
    stats_bytes: int
    cache: int = 0  # what the cached tensors need for every sample: the inputs and both networks at the widest cut
    estimate: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)  # group name -> why its statistics would not fit
    peak_rss: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        """One line for the user: the estimate, its largest parts, what was lowered."""
        parts = ", ".join(f"{k} {show_bytes(v)}" for k, v in sorted(self.parts.items(), key=lambda kv: -kv[1])[:3])
        done = f"; {'; '.join(self.actions)}" if self.actions else ""
        return (f"memory: about {show_bytes(self.estimate)} beyond the process expected ({parts}) of "
                f"{show_bytes(self.available)} available{done}")


def sample_bytes(tensor: gs.Tensor) -> int:
    """Bytes of one sample of ``tensor`` (0 where its shape past the batch is not static)."""
    shape = static_shape(tensor)
    if not shape or any(not isinstance(d, int) for d in shape[1:]):
        return 0
    return int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(tensor.dtype or np.float32).itemsize


def plan(analysis: Analysis, live: Liveness, samples: int, batch: int, fixed: bool, budget: int | None,
         available: Callable[[], int] | None = None, per_run: int | None = None) -> MemoryPlan:
    """The memory plan of a run on ``samples`` calibration samples at onnxruntime batch ``batch`` (``fixed``: the
    graph runs only at it), with the store's ``budget`` as given (None: half of what is available); ``per_run``:
    the bytes of activations one run should stay within (``RUN_BYTES`` on the CPU; None: no bound)."""
    free = (available or available_memory)()
    graph = analysis.graph
    nodes = {n.name: n for n in graph.nodes}
    macs = {e.node: e.macs for e in analysis.macs.entries}
    held = {g.name: consumer_bytes(g, nodes, macs) for g in analysis.groups}
    unfold = max((u for u, _ in held.values()), default=0)
    statistics = {g.name: held[g.name][1] for g in analysis.groups if g.prunable}
    tensors = graph.tensors()
    size = {name: sample_bytes(t) for name, t in tensors.items()}
    inputs = {t.name for t in graph.inputs}
    positions = range(len(graph.nodes) + 1)
    live_at = [sum(size.get(t, 0) for t in live.live(p)) for p in positions]
    peak = max((live_at[p] + sum(size.get(t.name, 0) for t in graph.nodes[p].outputs)
                for p in range(len(graph.nodes))), default=0)
    cuts = {live.position[use.node] for group in analysis.groups for use in group.consumers}
    widest = max((sum(size.get(t, 0) for t in live.live(c) - inputs) for c in cuts), default=0)
    cache = samples * (sum(size.get(t, 0) for t in inputs) + 2 * widest)
    weights = sum(int(np.asarray(t.values).nbytes) for t in tensors.values() if isinstance(t, gs.Constant))
    run = batch
    if per_run is not None and not fixed:  # the largest power of two within per_run, at least 2
        run = min(batch, max(2, 1 << max(0, (per_run // max(peak, 1)).bit_length() - 1)))
    result = MemoryPlan(free, free // 2 if budget is None else budget, run,
                        min(STATS_BYTES, max(MIN_STATS_BYTES, (free if budget is None else 4 * budget) // 8)), cache)
    outputs = samples * sum(size.get(t.name, 0) for t in graph.outputs)

    def parts() -> dict[str, int]:
        return {"cached tensors": min(cache, result.budget), "onnxruntime batch": 2 * result.run_batch * peak,
                "statistics": min(result.stats_bytes, 2 * batch * unfold), "outputs": 2 * outputs,
                "weights": 3 * weights}

    room = int(FIT * free)
    over = sum(parts().values()) - room
    if over > 0 and cache > 0 and budget is None:
        result.budget = max(0, result.budget - over)
        result.actions.append(f"the cached tensors past {show_bytes(result.budget)} spill to disk")
    over = sum(parts().values()) - room
    if over > 0 and not fixed and run > 1:
        result.run_batch = max(1, min(run, int((2 * run * peak - over) // max(2 * peak, 1))))
        result.actions.append(f"onnxruntime runs {result.run_batch} sample(s) at a time")
    over = sum(parts().values()) - room
    if over > 0 and result.stats_bytes > MIN_STATS_BYTES:
        result.stats_bytes = max(MIN_STATS_BYTES, result.stats_bytes - over)
        result.actions.append(f"the statistics unfold at most {show_bytes(result.stats_bytes)} at a time")
    result.parts = parts()
    result.estimate = sum(result.parts.values())
    left = max(room - result.estimate, room // 2)  # a group whose statistics need more is left unpruned
    result.excluded = {name: (f"choosing its channels holds about {show_bytes(need)} of statistics (consumer {node} "
                              f"reads {columns} columns), more than the {show_bytes(left)} this run may use: give the "
                              "machine more memory to prune it") for name, (need, node, columns) in statistics.items()
                       if need > left}
    if result.excluded:
        result.actions.append(f"{len(result.excluded)} group(s) left unpruned: their statistics would not fit")
    return result


STATS_COPIES = 6
"""D×D float64 matrices that choosing one group's channels holds per consumer at once: the two folds' sums, their
merge, the group OMP's centred and regularised copies, and its basis (at most as large)."""


def consumer_bytes(group: Group, nodes: dict[str, gs.Node],
                   macs: dict[str, int]) -> tuple[int, tuple[int, str, int]]:
    """From shapes only, what ``group``'s consumers hold: the largest one sample's unfolded input (its MACs over its
    output channels) and output take, float32; and what choosing the group's channels holds for their statistics
    (float64, ``STATS_COPIES`` of each consumer's D×D and D×O sums, D its columns: input channels × kernel taps), with
    the widest consumer and its D."""
    unfold, total, widest, columns = 0, 0, "", 0
    for use in group.consumers:
        node = nodes[use.node]
        out = static_shape(node.outputs[0])
        if out and len(out) >= 2 and all(isinstance(d, int) for d in out[1:]):
            unfold = max(unfold, 4 * (macs.get(use.node, 0) // max(out[1], 1) + math.prod(out[1:])))
        entry = lookup(node.op)
        weight = static_shape(node.inputs[1])
        axis = entry.mixing.axis(node) if entry is not None and entry.mixing is not None else None
        if not weight or not out or axis is None or not isinstance(out[axis], int) or not out[axis]:
            continue
        o = out[axis]
        d = math.prod(weight) // o
        total += 8 * STATS_COPIES * (d * d + d * o)
        if d > columns:
            widest, columns = use.node, d
    return unfold, (total, widest, columns)


def peak_rss(status: Path = Path("/proc/self/status")) -> int:
    """The peak resident memory of this process so far, in bytes: Linux's VmHWM, the high-water mark of this
    process's own memory. ``ru_maxrss`` (the fallback elsewhere) is not: a process started by a large one (a
    benchmark's Python, through vfork and exec) reports the parent's resident size at the start as its own peak."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
