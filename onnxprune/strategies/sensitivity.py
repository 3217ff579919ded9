"""How much the network's output degrades when one group alone is pruned: the output allocation's curves.

For each prunable group and a few candidate widths, the group is pruned ALONE on the original network (group
OMP selection, then the least-squares refit of its consumers, fitted on one half of a calibration subset, its
ridge cross-validated at the widest width and kept for the narrower ones) and the network's final output is
compared with the original's on the other half by the task's discrepancy (``onnxprune.tasks``: KL for a
classifier's logits, class scores and boxes for a detector, relative squared error per output otherwise). A
detector's probe samples are those on which the original finds an object, where the calibration set has them
(``_objects_first``). Only the part of the graph after the group's cut runs per candidate (from the cached
tensors at the cut), one onnxruntime session per group with its consumers' weights fed (``FedCut``).
The probed points become a piecewise-linear curve per group that ``allocation.curve_widths`` spends the
budget on, sensitivities summed as if independent.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from onnxprune.analysis import consumers
from onnxprune.analysis.groups import Group
from onnxprune.core.context import Context, Progress
from onnxprune.budget.cost import group_step
from onnxprune.errors import AnalysisError, CalibrationError
from onnxprune.imitation.omp import PROBE_WORK, stats_omp
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import refit_cv, refit_full
from onnxprune.strategies.downstream import FedCut
from onnxprune.strategies.objects import evenly, float_outputs, outputs, task_of, with_objects
from onnxprune.tasks import Detect, Judge, Task


PROBE_PASSES = 4  # the probes' budget, in forward passes of the calibration set
MIN_PROBE_SAMPLES = 4


@dataclass
class Sensitivity:
    """The probed output discrepancy of each group by width, and what probing cost."""

    probes: dict[str, dict[int, float]] = field(default_factory=dict)  # group name -> {width: discrepancy}
    fit_samples: int = 0
    probe_samples: int = 0
    seconds: float = 0.0
    task: str = "raw"  # how the outputs were compared (``onnxprune.tasks``)
    with_objects: int | None = None  # a detector's probe samples on which the original finds an object
    scanned: tuple[int, int] | None = None  # where the probes looked for objects: (samples with one, samples looked at)


def objects_seen(allocation: dict | None) -> tuple[int, int] | None:
    """From a report's ``allocation`` (a ``Sensitivity`` as a dict): how many of the calibration samples the probes
    looked at show an object to the original, of how many (the probing half where the probes looked for objects:
    the probe samples then hold them whatever the set's share); None for another task or allocation."""
    found = None if allocation is None else allocation.get("with_objects")
    if found is None:
        return None
    scanned = allocation.get("scanned")
    return (found, allocation["probe_samples"]) if scanned is None else tuple(scanned)


def candidate_widths(channels: int, ratios: tuple[float, ...], round_to: int, unit: int = 1) -> list[int]:
    """The widths probed: each ratio of the channels rounded to the group's step, narrowest last."""
    step = group_step(channels, round_to, unit)
    widths = {min(channels, max(step, int(round(r * channels / step)) * step)) for r in ratios}
    return sorted(widths - {channels}, reverse=True)


def curve_of(channels: int, probes: Mapping[int, float]) -> np.ndarray:
    """The discrepancy at every width 0..channels: 0 at full width, linear between probed widths, the
    narrowest probe's value below it (non-increasing in width: a probe lower than a narrower one's is raised).
    At width 0: the probe of the block's removal, if there is one, else infinite (not a choice)."""
    widths = sorted(w for w in probes if w > 0)
    xs = np.array([*widths, channels], dtype=float)
    ys = np.array([probes[w] for w in widths] + [0.0])
    ys = np.maximum.accumulate(ys[::-1])[::-1]
    curve = np.interp(np.arange(channels + 1), xs, ys)
    curve[0] = max(probes[0], curve[1]) if 0 in probes else np.inf
    return curve


def after_cut(ctx: Context, order: list[tuple[int, Group]]) -> list[float]:
    """The share of the network's MACs that runs after each group's cut (what one probe sample costs, in whole
    forward passes)."""
    position = ctx.live.position
    entries = [(position[e.node], e.macs) for e in ctx.analysis.macs.entries]
    total = sum(m for _, m in entries) or 1
    return [sum(m for p, m in entries if p >= cut) / total for cut, _ in order]


def probe_count(n: int, most: int, widths: Sequence[int], shares: Sequence[float]) -> int:
    """How many samples the probes run on: at most ``most``, and so that all the probes together (``widths[i]``
    runs of the graph after group i's cut, ``shares[i]`` of the network each) cost at most ``PROBE_PASSES``
    forward passes of the ``n`` calibration samples; never fewer than ``MIN_PROBE_SAMPLES``. A detector's
    many groups and few calibration images would otherwise make probing cost dozens of forward passes."""
    per_sample = sum(w * s for w, s in zip(widths, shares, strict=True))
    if per_sample <= 0:
        return most
    return int(min(most, max(MIN_PROBE_SAMPLES, PROBE_PASSES * n // per_sample)))


def split(n: int, fit: int, probe: int, need: int = 4, who: tuple[str, str, str] = (
        "the output allocation", "allocate with epsilon", "allocation")) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sample indices to fit on and to probe on: alternate pairs (an image and its mirror, adjacent
    with --flip, stay on one side), each side thinned evenly to at most ``fit`` / ``probe`` samples. Fewer than
    ``need`` on the fitting side is a CalibrationError naming ``who`` (what needs them, the way out, the
    option)."""
    sides = _sides(n)
    if len(sides[0]) < need or not len(sides[1]):  # the output allocation's refit cross-validates on two folds
        least = max(3, 4 * ((need - 1) // 2) + (need - 1) % 2 + 1)  # side 0 holds samples 0, 1, 4, 5, 8, ...
        raise CalibrationError(f"{who[0]} needs at least {least} calibration samples (got {n}): give more, "
                               f"or {who[1]}", option=who[2])
    return evenly(sides[0], fit), evenly(sides[1], probe)


def _sides(n: int) -> tuple[np.ndarray, np.ndarray]:
    """``split``'s two sides of ``n`` samples before thinning: alternate pairs, 0, 1, 4, 5, ... and 2, 3, 6, 7, ..."""
    pair = np.arange(n) // 2 % 2
    return np.flatnonzero(pair == 0), np.flatnonzero(pair == 1)


def output_curves(ctx: Context, order: list[tuple[int, Group]], ratios: tuple[float, ...], fit_samples: int,
                  probe_samples: int, on_layer: Progress | None = None, removable: Collection[int] = ()
                  ) -> tuple[dict[int, np.ndarray], Sensitivity]:
    """Each group's output-discrepancy curve (``curve_of``) from probes at ``ratios`` of its channels, and at
    width 0 (the block removed) for the groups in ``removable``."""
    t0 = time.perf_counter()
    n = len(next(iter(ctx.inputs.values())))
    plans = [candidate_widths(g.channels, ratios, ctx.options.round_to, g.unit) + [0] * (g.id in removable)
             for _, g in order]
    probe_samples = probe_count(n, probe_samples, [len(w) for w in plans], after_cut(ctx, order))
    fit, probe = split(n, fit_samples, probe_samples)
    floats = float_outputs(ctx.original)
    if not floats:
        raise AnalysisError("the output allocation compares float outputs, and this graph has none: allocate with "
                            "epsilon", option="allocation")
    reference = outputs(ctx, probe, floats)
    task = task_of(ctx, reference, probe)
    scanned = None
    if isinstance(task, Detect):
        probe, reference, scanned = _objects_first(ctx, task, probe, reference, floats)
    values = {name: np.ascontiguousarray(np.concatenate([v[fit], v[probe]])) for name, v in ctx.inputs.items()}
    report = Sensitivity(fit_samples=len(fit), probe_samples=len(probe), task=task.name, scanned=scanned,
                         with_objects=int(task.with_objects(reference).sum()) if isinstance(task, Detect) else None)
    curves, judge = {}, task.judge(reference)
    for i, (cut, group) in enumerate(order):
        if on_layer is not None:
            on_layer(i, len(order), f"probing {group.name}")
        ctx.advance(ctx.original, values, cut)
        ahead = ctx.peek(ctx.original, values, {use.tensor for use in group.consumers})
        fitted = {k: v[: len(fit)] for k, v in ahead.items()}
        at_cut = {k: v[len(fit):] for k, v in values.items()}
        probes = _probe(ctx, group, fitted, at_cut, reference, plans[i], judge, fit)
        report.probes[group.name] = probes
        curves[group.id] = curve_of(group.channels, probes)
    report.seconds = time.perf_counter() - t0
    return curves, report


def _objects_first(ctx: Context, task: Detect, probe: np.ndarray, reference: list[dict[str, np.ndarray]],
                   floats: list[str]) -> tuple[np.ndarray, list[dict[str, np.ndarray]], tuple[int, int] | None]:
    """A detector's probe samples, their reference outputs, and where the probes looked for objects (samples with
    one, samples looked at; None where they did not look): where some of ``probe`` show no object, as many of the
    probing side's samples (``split``'s side 1) with an object as the probes hold, the others evenly from those
    without; the original runs on that side only where the run has not looked already (``ctx.found``).
    On a few images without objects the allocation would be judged where there is nothing to find:
    YOLOv8n at 0.70× calibrated on 58 photos with objects and 192 without keeps mAP50-95 0.602 with 13 of its 13
    probe samples on objects, 0.543 with the 3 of 13 evenly spaced ones (0.675 on the 58 alone)."""
    if task.with_objects(reference).all():
        return probe, reference, None
    side = _sides(len(next(iter(ctx.inputs.values()))))[1]
    found = with_objects(ctx, task, side, floats)[0] if ctx.found is None else ctx.found[side]
    some = evenly(side[found], len(probe))
    chosen = np.sort(np.concatenate([some, evenly(side[~found], len(probe) - len(some))]))
    return chosen, outputs(ctx, chosen, floats), (int(found.sum()), len(side))


def _probe(ctx: Context, group: Group, fitted: dict[str, np.ndarray], at_cut: dict[str, np.ndarray],
           reference: list[dict[str, np.ndarray]], widths: list[int], judge: Judge | None = None,
           samples: np.ndarray | None = None) -> dict[int, float]:
    """{width: output discrepancy} of ``group`` alone pruned to each width (OMP + refit on ``fitted``, the
    calibration ``samples``; width 0: only the bias, the mean target), run from the tensors ``at_cut`` of the probe
    samples; ``judge``: the task's discrepancy against ``reference`` (``Task.judge``; None: the raw one)."""
    if not widths:
        return {}
    judge = judge or Task("raw").judge(reference)
    data = ctx.collect(group, fitted, fitted, samples=samples)
    top = max(widths)
    path = stats_omp([d.stats for d in data], [d.current.k for d in data], top, work=PROBE_WORK) if top else None
    # one session for every width, the consumers' weights its inputs; it runs each width once, on a few samples,
    # where pre-packing a large Gemm costs more than the runs (VGG-11: 1.1 -> 0.65 s a session)
    downstream = FedCut(ctx.original, at_cut, [d.use.node for d in data], list(reference[0]),
                        provider=ctx.options.provider, prepack=False,
                        exact_batch=None if ctx.fixed_batch is None else ctx.fixed_batch.size)
    nodes = {n.name: n for n in ctx.original.nodes}
    bases = [consumers.cleared(ctx.original, nodes[d.use.node], group, d.use) for d in data]
    ridges: list[float | None] = [None] * len(data)  # cross-validated at the widest width, kept for the others
    out = {}
    for width in widths:
        keep = path.support(width) if width else np.zeros(0, dtype=np.int64)
        linears = []
        for j, (d, base) in enumerate(zip(data, bases)):
            cols = expand(keep, d.current.k)
            prior = d.current.weight[:, cols]
            if width and ridges[j] is None:
                w, bias, ridges[j] = refit_cv(d.folds, cols, prior=prior, merged=d.stats)
            elif width:
                w, bias = refit_full(d.stats, cols, ridges[j], prior=prior)
            else:  # the columns stay cleared: the consumer writes its bias alone, as the removed block does
                w, bias = np.zeros((len(base.base.weight), 0)), d.stats.st / max(d.stats.count, 1)
            linears.append(base.with_group(cols, w, bias))
        out[width] = judge(downstream.run(linears, downstream.at_cut, ctx.run_batch))
    return out

