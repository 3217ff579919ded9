"""How much the network's output degrades when one group alone is pruned: the output allocation's curves.

For each prunable group and a few candidate widths, the group is pruned ALONE on the original network (group
OMP selection, then the cross-validated least-squares refit of its consumers, fitted on one half of a
calibration subset) and the network's final output is compared with the original's on the other half: KL
for a classifier's logits (2-D outputs), relative squared error otherwise, summed over the float outputs.
Only the part of the graph after the group's cut runs per candidate (from the cached tensors at the cut).
The probed points become a piecewise-linear curve per group that ``allocation.curve_widths`` spends the
budget on, sensitivities summed as if independent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis import consumers
from onnxprune.analysis.groups import Group
from onnxprune.cost import group_step
from onnxprune.errors import AnalysisError, CalibrationError
from onnxprune.evaluation import log_softmax
from onnxprune.imitation.omp import stats_omp
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import refit_cv
from onnxprune.runtime.segments import cut_graph, run_cut

if TYPE_CHECKING:
    from onnxprune.pipeline import Compressor

Progress = Callable[[int, int, str], None]


@dataclass
class Sensitivity:
    """The probed output discrepancy of each group by width, and what probing cost."""

    probes: dict[str, dict[int, float]] = field(default_factory=dict)  # group name -> {width: discrepancy}
    fit_samples: int = 0
    probe_samples: int = 0
    seconds: float = 0.0


def output_discrepancy(reference: Sequence[Mapping[str, np.ndarray]], outputs: Sequence[Mapping[str, np.ndarray]]
                       ) -> float:
    """Summed over the float outputs of chunks of samples (each chunk: output name -> array, as the graph gives
    it): the mean KL(softmax(reference) || softmax(output)) over the rows of a 2-D output with several columns
    (logits), else the squared error's energy over the reference's."""
    kl, rows, err, energy = {}, {}, {}, {}
    for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
        for name, ref in ref_chunk.items():
            ref, y = ref.astype(np.float64), out_chunk[name].astype(np.float64)
            if ref.ndim == 2 and ref.shape[1] > 1:
                log_p, log_q = log_softmax(ref), log_softmax(y)
                kl[name] = kl.get(name, 0.0) + float(np.sum(np.exp(log_p) * (log_p - log_q)))
                rows[name] = rows.get(name, 0) + len(ref)
            else:
                err[name] = err.get(name, 0.0) + float(np.sum(np.square(y - ref)))
                energy[name] = energy.get(name, 0.0) + float(np.sum(np.square(ref)))
    return sum(kl[k] / rows[k] for k in kl) + sum(err[k] / max(energy[k], 1e-30) for k in err)


def candidate_widths(channels: int, ratios: tuple[float, ...], round_to: int) -> list[int]:
    """The widths probed: each ratio of the channels rounded to the group's step, narrowest last."""
    step = group_step(channels, round_to)
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


def split(n: int, fit: int, probe: int, need: int = 4, who: tuple[str, str, str] = (
        "the output allocation", "allocate with epsilon", "allocation")) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint sample indices to fit on and to probe on: alternate pairs (an image and its mirror, adjacent
    with --flip, stay on one side), each side thinned evenly to at most ``fit`` / ``probe`` samples. Fewer than
    ``need`` on the fitting side is a CalibrationError naming ``who`` (what needs them, the way out, the
    option)."""
    pair = np.arange(n) // 2 % 2
    sides = [np.flatnonzero(pair == 0), np.flatnonzero(pair == 1)]
    if len(sides[0]) < need or not len(sides[1]):  # the output allocation's refit cross-validates on two folds
        least = max(3, 4 * ((need - 1) // 2) + (need - 1) % 2 + 1)  # side 0 holds samples 0, 1, 4, 5, 8, ...
        raise CalibrationError(f"{who[0]} needs at least {least} calibration samples (got {n}): give more, "
                               f"or {who[1]}", option=who[2])
    return tuple(s[np.linspace(0, len(s) - 1, min(m, len(s))).round().astype(int)] for s, m in zip(sides, (fit, probe)))


def output_curves(run: Compressor, order: list[tuple[int, Group]], ratios: tuple[float, ...], fit_samples: int,
                  probe_samples: int, on_layer: Progress | None = None, removable: Collection[int] = ()
                  ) -> tuple[dict[int, np.ndarray], Sensitivity]:
    """Each group's output-discrepancy curve (``curve_of``) from probes at ``ratios`` of its channels, and at
    width 0 (the block removed) for the groups in ``removable``."""
    t0 = time.perf_counter()
    n = len(next(iter(run.inputs.values())))
    fit, probe = split(n, fit_samples, probe_samples)
    values = {name: np.ascontiguousarray(np.concatenate([v[fit], v[probe]])) for name, v in run.inputs.items()}
    floats = [t.name for t in run.original.outputs if t.dtype is None or np.issubdtype(np.dtype(t.dtype), np.floating)]
    if not floats:
        raise AnalysisError("the output allocation compares float outputs, and this graph has none: allocate with "
                            "epsilon", option="allocation")
    probe_values = {k: v[len(fit):] for k, v in values.items()}
    reference = _run(run, cut_graph(run.original, probe_values, floats), probe_values)
    report = Sensitivity(fit_samples=len(fit), probe_samples=len(probe))
    curves = {}
    for i, (cut, group) in enumerate(order):
        if on_layer is not None:
            on_layer(i, len(order), f"probing {group.name}")
        run.advance(run.original, values, cut)
        ahead = run.peek(run.original, values, {use.tensor for use in group.consumers})
        fitted = {k: v[: len(fit)] for k, v in ahead.items()}
        at_cut = {k: v[len(fit):] for k, v in values.items()}
        widths = candidate_widths(group.channels, ratios, run.options.round_to) + [0] * (group.id in removable)
        probes = _probe(run, group, fitted, at_cut, reference, widths)
        report.probes[group.name] = probes
        curves[group.id] = curve_of(group.channels, probes)
    report.seconds = time.perf_counter() - t0
    return curves, report


def _probe(run: Compressor, group: Group, fitted: dict[str, np.ndarray], at_cut: dict[str, np.ndarray],
           reference: list[dict[str, np.ndarray]], widths: list[int]) -> dict[int, float]:
    """{width: output discrepancy} of ``group`` alone pruned to each width (OMP + refit on ``fitted``; width 0:
    only the bias, the mean target), run from the tensors ``at_cut`` of the probe samples."""
    if not widths:
        return {}
    data = run.collect(group, fitted, fitted)
    top = max(widths)
    path = stats_omp([d.stats for d in data], [d.current.k for d in data], top) if top else None
    downstream = cut_graph(run.original, at_cut, reference[0].keys())  # copied once, re-weighted per width
    nodes = {n.name: n for n in run.original.nodes}
    mine = {n.name: n for n in downstream.nodes}
    bases = [consumers.cleared(run.original, nodes[d.use.node], group, d.use) for d in data]
    out = {}
    for width in widths:
        keep = path.support(width) if width else np.zeros(0, dtype=np.int64)
        for d, base in zip(data, bases):
            cols = expand(keep, d.current.k)
            if width:
                w, bias, _ = refit_cv(d.folds, cols, prior=d.current.weight[:, cols])
            else:  # the columns stay cleared: the consumer writes its bias alone, as the removed block does
                w, bias = np.zeros((len(base.base.weight), 0)), d.stats.st / max(d.stats.count, 1)
            consumers.write(downstream, mine[d.use.node], base.with_group(cols, w, bias))
        downstream.cleanup().toposort()  # a MatMul's first bias adds a node
        out[width] = output_discrepancy(reference, _run(run, downstream, at_cut))
    return out


def _run(run: Compressor, cut: gs.Graph, values: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The outputs of the ``cut_graph`` ``cut`` on ``values``, chunk by chunk as the graph runs (an output need
    not have the samples on its first axis: a sequence-first recogniser's does not)."""
    chunks, _ = run_cut(cut, values, provider=run.options.provider, batch_size=run.run_batch,
                        exact=run.fixed_batch is not None)
    return [arrays for _, arrays in chunks]
