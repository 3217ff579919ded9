"""The pruning loop: pre-flight, schedule, budget, allocation, then each group pruned at its cut; the report."""

from __future__ import annotations

import time
from dataclasses import asdict
from functools import partial

import onnx

from onnxprune.budget.allocation import check_target
from onnxprune.analysis import analyze
from onnxprune.analysis.groups import Group
from onnxprune.analysis.macs import count_params
from onnxprune.calib.sources import CalibrationSet
from onnxprune.core.context import Progress
from onnxprune.budget.cost import Spend
from onnxprune.errors import TargetError
from onnxprune.ir.probe import FixedBatch
from onnxprune.pipeline.compressor import Compressor
from onnxprune.pipeline.memory import peak_rss
from onnxprune.pipeline.preflight import preflight
from onnxprune.pipeline.report import CompressReport
from onnxprune.pipeline.schedule import schedule
from onnxprune.strategies import CompressOptions


def compress(
    model: onnx.ModelProto,
    calib: CalibrationSet,
    options: CompressOptions,
    on_layer: Progress | None = None,
) -> tuple[onnx.ModelProto, CompressReport]:
    """Prune ``model`` to the options' budget. ``on_layer(i, total, label)`` reports progress."""
    start = time.perf_counter()
    _progress(on_layer, 0, 0, "analysing the graph")
    run = Compressor(model, calib, options)
    _check_batch(run.fixed_batch or run.written_batch, options)
    candidates, _ = schedule(run.analysis, run.live, options.residual_streams)
    checked = preflight(run.analysis.graph, [g for _, g in candidates],
                        on_status=None if on_layer is None else lambda text: on_layer(0, len(candidates), text))
    run.exclude_batchless(candidates)
    run.keep_objects(None if on_layer is None else lambda done, n: on_layer(
        done, n, "scanning the calibration samples for objects (a detector)"))
    order, skipped = schedule(run.analysis, run.live, options.residual_streams)
    spend = options.budget.resolve(run, [g for _, g in order], on_layer)
    widths, target, requested = _allocate(run, order, spend, on_layer)
    run.select = options.select.bind(run, order, widths)
    target_macs, requested_macs = spend.recorded(widths, target, requested)
    report = CompressReport(
        macs_before=run.analysis.macs.total, macs_after=0, params_before=run.analysis.params, params_after=0,
        target_macs=target_macs, options=options.to_dict(), provider="",
        calibration_samples=len(next(iter(run.values_p.values()))), skipped=skipped, requested_macs=requested_macs,
        fixed_batch=run.fixed_batch and asdict(run.fixed_batch), allocation=run.allocation,
        written_batch=run.written_batch and asdict(run.written_batch), preflight=checked.to_dict(),
        memory=run.memory.to_dict(), objects=run.objects and asdict(run.objects),
    )
    for i, (cut, group) in enumerate(order):
        _progress(on_layer, i, len(order), f"pruning {group.name}")
        run.cache.on_chunk = None if on_layer is None else partial(_samples, on_layer, i, len(order), group.name)
        run.on_status = None if on_layer is None else partial(_status, on_layer, i, len(order), group.name)
        layer = run.prune(cut, group, widths[group.id])
        if layer is not None:
            report.layers.append(layer)
    run.refit_pending(len(run.graph.nodes) + 1)
    _progress(on_layer, len(order), len(order), "")
    pruned = run.export()
    after = analyze(pruned)
    report.macs_after = after.macs.total
    report.params_after = count_params(after.graph)
    report.provider = run.cache.ran or options.provider
    report.latency = spend.outcome(model, pruned, widths, target, requested,
                                   lambda label: _progress(on_layer, len(order), len(order), label))
    report.selection = run.select.summary()
    report.seconds = time.perf_counter() - start
    report.memory["peak_rss"] = peak_rss()
    return pruned, report


def _allocate(run: Compressor, order: list[tuple[int, Group]], spend: Spend, on_layer: Progress | None
              ) -> tuple[dict[int, int], float, float | None]:
    """The widths the allocator gives within ``spend``, the target they were allocated to, and the budget
    asked for when best_effort raised it to the lowest reachable (else None)."""
    options, groups = run.options, [g for _, g in order]
    target, requested = spend.target, None
    if options.best_effort:
        lowest = options.allocate.lowest(spend.cost, groups, options.min_channels, options.round_to)
        if target < lowest:
            requested, target = target, lowest
    # before the curves, which may take minutes: an unreachable target is the user's to fix at once
    check_target(spend.cost, groups, target, options.min_channels, options.round_to, options.allocate.floor)
    _progress(on_layer, 0, len(order), run.memory.line())  # before the first long work, after the checks
    curves, run.allocation = options.allocate.curves(run, order, on_layer)
    widths = options.allocate.widths(spend.cost, groups, curves, target, options.min_channels, options.round_to)
    return widths, target, requested


def _samples(on_layer: Progress, i: int, total: int, name: str, done: int, samples: int) -> None:
    """Progress within a group: how many samples have been pushed to its cut (a long run stays visibly alive)."""
    _status(on_layer, i, total, name, f"{done}/{samples} samples")


def _status(on_layer: Progress, i: int, total: int, name: str, text: str) -> None:
    on_layer(i, total, f"pruning {name}: {text}")


def _progress(on_layer: Progress | None, i: int, total: int, label: str) -> None:
    if on_layer is not None:
        on_layer(i, total, label)


def _check_batch(fixed: FixedBatch | None, options: CompressOptions) -> None:
    """What a graph that fixes its batch cannot do: a latency budget timed at another batch."""
    if fixed is None:
        return
    batch = options.budget.timing_batch()
    if batch is not None and batch != fixed.size:
        raise TargetError(f"latency batch {batch}: this graph runs only at batch {fixed.size} "
                          f"({fixed.reason}): time it at batch {fixed.size}", option="latency_batch")
