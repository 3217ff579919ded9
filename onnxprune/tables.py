"""What the command line prints: the summary of a compress or a recovery, and the tables of eval and bench (rich
stays here and in ``onnxprune.cli``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onnxprune.analysis import Analysis
from onnxprune.budget.cost import format_ms
from onnxprune.deploy.bench import BenchResult
from onnxprune.deploy.quantize import QuantizeReport
from onnxprune.deploy.evaluation import EvalResult
from onnxprune.pipeline import CompressReport, LatencyReport
from onnxprune.progress import Heartbeat
from onnxprune.recovery import RecoverReport
from onnxprune.recovery.report import DistillReport, SegmentReport
from onnxprune.recovery.train import PATIENCE
from onnxprune.recovery.verdict import RESAMPLES
from onnxprune.ir.store import show_bytes
from onnxprune.strategies.sensitivity import objects_seen
from onnxprune.sweep import SweepResult, SweepRow

console = Console(width=None if sys.stdout.isatty() else 140)  # logs and pipes get readable tables
err_console = Console(stderr=True)
PROBED = "calibration samples the probes looked at"  # what a detector's objects are counted on in compress


def mmacs(value: float) -> str:
    return f"{value / 1e6:,.1f}M"


@contextmanager
def progress(description: str, quiet: bool = False) -> Iterator[Callable[[int, int, str], None]]:
    """Progress on stderr, yielding ``advance(completed, total, description)``: a transient bar on a terminal,
    plain lines elsewhere (a log, CI, a notebook's subprocess; ``Heartbeat``), nothing with ``quiet``."""
    if quiet:
        yield lambda completed, total, label: None
        return
    if not err_console.is_terminal:
        with Heartbeat(description) as heartbeat:
            yield heartbeat.update
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err_console, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def advance(completed: int, total: int, label: str) -> None:
            progress.update(task, completed=completed, total=total, description=label)

        yield advance


def print_analysis(result: Analysis, model: Path) -> None:
    """analyze's table of groups and its lines: MACs, what is not counted, the task read, the pre-flight."""
    table = Table(title=f"{model}: channel groups")
    for col in ("id", "group (first producer)", "channels", "producers", "consumers", "prunable"):
        table.add_column(col)
    for g in result.groups:
        status = (f"[green]yes[/]{' (a removable block)' * (g.id in result.blocks)}" if g.prunable
                  else f"[red]no[/]: {g.reason}")
        width = f"{g.channels * g.unit} ({g.channels} {g.units})" if g.unit > 1 else str(g.channels)
        table.add_row(str(g.id), g.name, width, str(len(g.producers)), str(len(g.consumers)), status)
    console.print(table)
    console.print(f"MACs {mmacs(result.macs.total)}, params {result.params / 1e6:.2f}M, "
                  f"{len(result.prunable)}/{len(result.groups)} groups prunable, "
                  f"{result.prunable_share():.0%} of MACs touch a prunable group")
    for where in result.uncounted:
        console.print(f"not counted: the MACs inside the subgraph of {where}, which is left as it is")
    for where in result.macs.unknown:
        console.print(f"not counted: the MACs of {where}")
    if result.task is not None:
        console.print(f"task: {result.task} (read from the outputs' layout; compress and eval compare outputs as "
                      "this task, --task names another)")
    checked = result.preflight
    if checked is not None:
        console.print(f"pre-flight not run: {checked['not_run']}" if checked["not_run"] else
                      f"pre-flight: {checked['groups']} groups pruned at once in a copy, {len(checked['excluded'])} "
                      f"excluded, {checked['trials']} onnxruntime run(s) in {checked['seconds']:.1f} s")


def print_compress(result: CompressReport, method: str, allocation: str, reconstruct: str, round_to: int,
                   output: Path) -> None:
    table = Table(title=f"pruned {len(result.layers)} groups ({method}, allocation={allocation}, "
                        f"reconstruct={reconstruct})")
    chosen = any(layer.selection for layer in result.layers)
    for col in ("group", "kept", *(("selected by",) * chosen), "greedy loss", "error (fold)", "error", "s"):
        table.add_column(col)
    for layer in result.layers:
        greedy = "-" if layer.imitation_loss is None else f"{layer.imitation_loss:.3f}"
        width = f"{layer.kept * layer.unit}/{layer.channels * layer.unit}" + (
            f" ({layer.kept}/{layer.channels} {layer.units})" if layer.unit > 1 else "")
        kept = width if layer.kept else f"block removed (0/{layer.channels * layer.unit})"
        by = (_selected_by(layer.selection),) * chosen
        table.add_row(layer.group, kept, *by, greedy, f"{layer.error_fold:.3f}", f"{layer.error:.3f}",
                      f"{layer.seconds:.1f}")
    console.print(table)
    if result.selection is not None:
        sel = result.selection
        console.print(f"auto: global imitation took {sel['spent_s']:.0f} s of its {sel['budget_s']:.0f} s budget "
                      f"on {sum(1 for x in result.layers if x.selection and 'global' in x.selection)} groups")
    for s in result.skipped:
        console.print(f"[dim]not pruned: {s['group']} ({s['channels']} ch): {s['reason']}[/]")
    finer = [layer for layer in result.layers if layer.step * layer.unit < round_to]
    if finer:
        console.print(f"{len(finer)} groups narrower than {4 * round_to} channels were cut in finer steps than "
                      f"--round-to {round_to}: " + ", ".join(f"{x.group} ({x.kept * x.unit}/{x.channels * x.unit}, "
                                                              f"step {x.step * x.unit})" for x in finer))
    if result.written_batch is not None:
        console.print(f"the input fixes the batch ({result.written_batch['reason']}) and nothing in the graph does: "
                      f"calibration batched samples through a copy with a free batch; the written model keeps batch "
                      f"{result.written_batch['size']}")
    if result.fixed_batch is not None:
        console.print(f"the graph fixes its batch ({result.fixed_batch['reason']}): calibration ran "
                      f"{result.fixed_batch['size']} sample(s) at a time")
    _print_objects(result.objects, objects_seen(result.allocation))
    if result.requested_macs is not None:
        console.print(f"--best-effort: the budget of {mmacs(result.requested_macs)} MACs is below the lowest "
                      f"reachable {mmacs(result.target_macs)}: pruned to the lowest reachable MACs instead")
    if result.latency is not None:
        _print_latency(result.latency)
    if result.memory is not None:
        mem = result.memory
        done = f"; {'; '.join(mem['actions'])}" if mem["actions"] else ""
        console.print(f"memory: peak RSS {show_bytes(mem['peak_rss'])} (about {show_bytes(mem['estimate'])} beyond the "
                      f"process was expected, {show_bytes(mem['available'])} available at the start{done})")
    console.print(
        f"MACs {mmacs(result.macs_before)} → {mmacs(result.macs_after)} "
        f"({result.macs_after / result.macs_before:.1%}), params {result.params_before / 1e6:.2f}M → "
        f"{result.params_after / 1e6:.2f}M, {result.calibration_samples} calibration samples, "
        f"{result.seconds:.1f}s on {result.provider}; wrote {output}"
    )


def _print_objects(kept: dict | None, probed: tuple[int, int] | None) -> None:
    """A detector's note: the samples the object filter kept (``kept``, a report's ``objects``), else the probes'
    count of samples with objects (``probed``), else nothing."""
    if kept is not None:
        console.print(kept_note(**kept))
    elif probed is not None:
        console.print(objects_note(*probed, PROBED))


def kept_note(found: int, samples: int, kept: int) -> str:
    """Which of a detector's calibration samples ``compress`` fitted and probed on (``strategies.objects``)."""
    if found == samples:
        return f"detector: the original finds objects in all {samples} calibration samples"
    if not found:
        return (f"[yellow]detector: the original finds no object in any of the {samples} calibration samples, pruned "
                "on all of them; give it images like those it will see in use, with objects (docs/usage.md)[/]")
    others = f" and {kept - found} without, evenly spaced" if kept > found else ""
    return (f"detector: the original finds objects in {found} of the {samples} calibration samples: pruned on those "
            f"{found}{others} (--empty-samples: on all)")


def objects_note(found: int, n: int, samples: str) -> str:
    """How many of a detector's ``n`` ``samples`` show an object to the original, with advice where under three in
    four do: images without objects teach the pruning and the recovery little of what the detector finds (YOLOv8n
    at 0.70× calibrated on 58 photos with objects, on those and 192 without, on the 441-photo pool with the same 58:
    mAP50-95 0.675, 0.602, 0.536)."""
    text = f"detector: the original finds objects in {found} of the {n} {samples}"
    if 4 * found >= 3 * n:
        return text
    return (f"[yellow]{text}: a detector pruned or recovered on images mostly without objects keeps less of what it "
            "finds; give it images like those it will see in use, with objects in most (docs/usage.md)[/]")


def _selected_by(selection: dict | None) -> str:
    """The layer table's 'selected by' cell: the method, and with auto the two discrepancies or why global did
    not run."""
    if not selection:
        return "-"
    if "global" in selection and "omp" in selection:
        return f"{selection['method']} (KL-or-error omp {selection['omp']:.4f}, global {selection['global']:.4f})"
    return selection["method"] + (f": {selection['why']}" if "why" in selection else "")


def _print_latency(r: LatencyReport) -> None:
    """Predicted vs measured latency; a missed target is said on stderr, never passed over."""
    if r.requested_ms is not None:
        console.print(f"--best-effort: the latency budget of {format_ms(r.requested_ms)} is below the lowest reachable "
                      f"{format_ms(r.target_ms)} (predicted): pruned to the lowest reachable latency instead")
    where = f"{r.provider.removesuffix('ExecutionProvider')}, batch {r.batch}" + (
        f", {r.threads} threads" if r.threads else "")
    console.print(f"latency ({where}): target {format_ms(r.target_ms)}, predicted {format_ms(r.predicted_ms)}, measured "
                  f"{format_ms(r.measured_ms)} vs the original's {format_ms(r.original_ms)} "
                  f"({r.original_ms / r.measured_ms:.2f}x); cost table "
                  + (f"measured in {r.table_seconds:.0f}s" if r.table_seconds else "read from file"))
    if r.table_machine is not None:
        err_console.print(f"[bold yellow]warning:[/] the cost table was measured on another machine "
                          f"({escape(r.table_machine)}): its timings may not hold here; measure a new one (leave "
                          "out --cost-table)", highlight=False, soft_wrap=True)
    if not r.met:
        missed = (f"{r.measured_ms / r.original_ms:.2f}x of the original's latency misses the {r.target_ratio:g}x target"
                  if r.target_ratio is not None and r.requested_ms is None
                  else f"{format_ms(r.measured_ms)} misses the target {format_ms(r.target_ms)}")
        err_console.print(f"[bold yellow]warning:[/] the measured latency {missed} (predicted {format_ms(r.predicted_ms)}): "
                          "timings on a shared machine drift and the cost table's additive model errs; check with "
                          "`onnxprune bench`, or lower the target", highlight=False, soft_wrap=True)




def _best_step(stage: SegmentReport | DistillReport) -> str:
    return f"{stage.best_step}, stopped" if stage.stopped else str(stage.best_step)


def _gain_per_minute(stage: SegmentReport | DistillReport) -> str:
    """The stage's held-out loss fall, relative to its start, per minute it took."""
    gain = (stage.held_before - stage.held_after) / max(stage.held_before, 1e-30)
    return f"{gain / max(stage.seconds / 60, 1e-9):.1%}"


def print_recovery(r: RecoverReport) -> None:
    table = Table(title=f"recovery ({r.options['method']}): {len(r.segments)} segments trained")
    for col in ("stage", "params", "held-out loss before", "after", "best step", "s", "gain/min"):
        table.add_column(col)
    for seg in r.segments:
        again = f" (round {seg.round})" if seg.round > 1 else ""
        table.add_row(f"block → {seg.end[0]}{again}", f"{seg.parameters:,}", f"{seg.held_before:.4f}",
                      f"{seg.held_after:.4f}", _best_step(seg), f"{seg.seconds:.1f}", _gain_per_minute(seg))
    if r.distill is not None:
        d = r.distill
        part = "whole model" if d.whole_model else f"from {d.trained_from[0]}"
        trials = ", ".join(f"{lr:.0e}: {held:.4f}" for lr, held in d.lr_trials)
        lr = f"lr {d.lr:.0e}" + (f", the best held-out loss of trials at {trials}" if trials else "")
        table.add_row(f"distill ({part}; {d.samples:,} samples: {d.augment}; {lr})", f"{d.parameters:,}",
                      f"{d.held_before:.4f}", f"{d.held_after:.4f}", _best_step(d), f"{d.seconds:.1f}",
                      _gain_per_minute(d))
    console.print(table)
    if any(stage.stopped for stage in [*r.segments, *([r.distill] if r.distill else [])]):
        console.print(f"stopped: none of the stage's learning-rate trials, or of its first {PATIENCE} held-out "
                      "measures, beat its start, so it ended there with its starting weights; its time went to the "
                      "stages after it (after the last one, to another round of the block windows where they gained, "
                      "else the run ended early)", highlight=False, soft_wrap=True)
    console.print("gain/min: the held-out loss's fall, as a share of its start, per minute the stage took",
                  highlight=False, soft_wrap=True)
    if r.distill_choice:
        console.print(f"distillation: {r.distill_choice}", highlight=False, soft_wrap=True)
    if r.block_skipped:
        console.print(f"block stage: the segment → {r.block_skipped[0]} is the distilled head's only changed one, "
                      "left to the distillation (task objective, augmented views)", highlight=False, soft_wrap=True)
    agree = _agreement(r.agreement_before, r.agreement_after)
    verdict = ("kept the recovered weights" if r.improved else
               "the recovered weights were not better on the held-out samples: returned the input model unchanged")
    if r.confidence is not None:
        verdict += (f" (better on {r.confidence:.0%} of {RESAMPLES} resamples of those samples: the fewer they are, "
                    "the less sure)")
    if r.tie_objective is not None:
        verdict = (f"{r.metric} tied, so the objective decided there ({r.tie_objective[0]:.4f} → "
                   f"{r.tie_objective[1]:.4f}): {verdict}")
    held = "given apart" if r.held_unseen else "split off the calibration set"
    picked = r.samples_held - r.samples_verdict
    if r.with_objects is not None:
        console.print(objects_note(r.with_objects, r.samples_held, f"held-out samples ({r.verdict_with_objects} of "
                                   f"them among the {r.samples_verdict} that judge)"))
    console.print(f"held-out {r.metric} {r.before:.4f} → {r.after:.4f}{agree} on {r.samples_verdict} of "
                  f"{r.samples_held} held-out samples (the other {picked} picked the checkpoints; {held}; "
                  f"{r.samples_train} trained on), {r.seconds:.1f}s: {verdict}")
    if r.train_before is not None and r.train_after is not None:
        console.print(f"training {r.train_metric} {r.train_before:.4f} → {r.train_after:.4f}"
                      f"{_agreement(r.train_agreement_before, r.train_agreement_after)} on the {r.samples_train} "
                      "samples trained on: what these weights reach where they trained (the held-out score's distance "
                      "from it is what the samples did not teach)", highlight=False, soft_wrap=True)
    if r.samples_given > r.samples_train:
        console.print(f"trained on {r.samples_train} of the {r.samples_given} training samples, evenly drawn: the "
                      f"forward passes over every sample at each block take their share of --time "
                      f"{r.options['time']:.0f} s only for that many at this input size (more time, more samples)",
                      highlight=False, soft_wrap=True)


def _agreement(before: float | None, after: float | None) -> str:
    """The text ", agreement a → b" where both are known (a classifier's), else nothing."""
    return f", agreement {before:.1%} → {after:.1%}" if before is not None and after is not None else ""


_CLASSIFIER_COLUMNS = (("top-1", "top1", ".2%"), ("top-5", "top5", ".2%"), ("agree", "agreement", ".2%"), ("KL", "kl", ".4g"))


def format_table(results: dict[str, EvalResult]) -> Table:
    """A rich table with one row per model (keyed by its label) and one column per metric."""
    outputs = list(dict.fromkeys(name for r in results.values() for name in r.rel_l2))
    tasks = sorted({r.task for r in results.values() if r.task})
    table = Table(title=f"Fidelity ({', '.join(tasks)})" if tasks else "Fidelity")
    # the task's own scores first, each with its spread over the images (``±``) where it has one; a classifier's
    # columns only where some model has them
    metrics = list(dict.fromkeys(name for r in results.values() for name in r.metrics))
    classifier = [(header, attr, spec) for header, attr, spec in _CLASSIFIER_COLUMNS
                  if any(getattr(r, attr) is not None for r in results.values())]
    for header in ("model", "images", *metrics, *(header for header, _, _ in classifier)):
        table.add_column(header, justify="left" if header == "model" else "right")
    for name in outputs:
        suffix = f" {name}" if len(outputs) > 1 else ""
        table.add_column(f"rel-L2{suffix}", justify="right")
        table.add_column(f"cos{suffix}", justify="right")
    for label, r in results.items():
        row = [label, str(r.images), *(_with_sd(r.metrics.get(name), r.spread.get(name), ".4g") for name in metrics),
               *(_with_sd(getattr(r, attr), r.spread.get(attr), spec) for _, attr, spec in classifier)]
        for name in outputs:
            row += [_fmt(r.rel_l2.get(name), ".4g"), _fmt(r.cosine.get(name), ".5f")]
        table.add_row(*row)
    padded = sorted({name for r in results.values() for name in r.padded})
    if padded:
        table.caption = (f"{', '.join(padded)}: length varies from image to image; compared zero-padded to the "
                         "longer of the two")
    return table


def _with_sd(value: float | None, sd: float | None, spec: str) -> str:
    """A score in ``spec``, and ``± sd`` (its standard deviation over the images, two significant digits) if known."""
    if sd is None or value is None:
        return _fmt(value, spec)
    return f"{_fmt(value, spec)} ± {_fmt(sd, '.1%' if spec.endswith('%') else '.2g')}"


def format_sweep_table(result: SweepResult) -> Table:
    """One row per budget, the original first: MACs, params, latency and speed-up, the held-out task metric ± its
    spread over the samples; the INT8 models' speed-up and metric beside where they were made."""
    metric = result.rows[0].metric if result.rows else "fidelity"
    int8 = bool(result.rows) and all(r.int8 is not None for r in result.rows)
    table = Table(title=f"Sweep ({metric} against the original on {result.held})")
    headers = ["budget", "MACs", "× MACs", "params", "latency ms", "speed-up", metric]
    headers += ["INT8 speed-up", f"INT8 {metric}"] if int8 else []
    for header in (*headers, "compress s"):
        table.add_column(header, justify="left" if header == "budget" else "right")
    o = result.original
    table.add_row("original", mmacs(o["macs"]), "1.00", _count(o["params"]), _fmt(o["latency_ms"], ".2f"), "1.00",
                  "1", *(["-", "-"] if int8 else []), "-")
    chosen = result.keep and result.keep["chosen"]

    def score(row: SweepRow) -> str:
        return _fmt(row.fidelity, ".4f") + (f" ± {row.spread:.4f}" if row.spread else "")

    for r in result.rows:
        table.add_row(f"{r.target}{' (--keep)' if r.target == chosen else ''}", mmacs(r.macs), f"{r.mac_ratio:.2f}",
                      _count(r.params), _fmt(r.latency_ms, ".2f"), _fmt(r.speedup, ".2f"), score(r),
                      *([_fmt(r.int8.speedup, ".2f"), score(r.int8)] if int8 else []), f"{r.seconds:.0f}")
    return table


def print_sweep(result: SweepResult, folder: Path, kept: Path | None = None) -> None:
    """The sweep's table and where it wrote; ``--keep``'s choice (copied to ``kept`` by ``compress --keep``)."""
    console.print(format_sweep_table(result))
    console.print(f"wrote {len(result.rows)} models, sweep.json and sweep.png to {folder}; judged on {result.held}, "
                  f"{result.seconds:.0f} s in all")
    _print_objects(result.kept, result.objects)
    if result.keep is not None:
        row = next(r for r in result.rows if r.target == result.keep["chosen"])
        chosen = row.written
        console.print(f"--keep {result.keep['floor']:g}: the cheapest budget keeping {chosen.metric} less its spread "
                      f"is {chosen.target}{' (INT8)' if row.int8 else ''} ({chosen.mac_ratio:.2f}× MACs, "
                      f"{chosen.fidelity:.4f} ± {chosen.spread or 0:.4f}, at least {chosen.lower:.4f}; "
                      f"{result.keep['judged']} budgets judged)" + (f"; wrote it to {kept}" if kept else ""))


def print_quantize(r: QuantizeReport, output: Path) -> None:
    """quantize's candidates, the float input and the INT8 model against the reference, what stays in float."""
    table = Table(title=f"INT8 candidates ({r.runtime} layout), judged on {r.held_samples} held-out samples")
    for col, justify in (("calibration", "left"), ("in float", "left"), ("rounding", "left"), (r.metric, "right"),
                         ("KL", "right"), ("rel. L2", "right"), ("s", "right")):
        table.add_column(col, justify=justify)
    for c in r.candidates:
        chosen = (c.method, c.float_nodes, c.rounding) == (r.method, r.float_nodes, r.rounding)
        where = f"{len(c.float_nodes)} layers" + (f" (first and last {c.prefix})" if c.prefix else "")
        table.add_row(f"{c.method}{' (chosen)' if chosen else ''}", where if c.float_nodes else "-", c.rounding,
                      _fmt(c.value, ".4f"), _fmt(c.kl, ".4f"), f"{c.rel_l2:.4f}", f"{c.seconds:.0f}")
    console.print(table)

    def score(d: dict) -> str:
        spread = f" ± {d['spread']:.4f}" if d.get("spread") is not None else ""
        return f"{r.metric} {_fmt(d['value'], '.4f')}{spread}" + (f", top-1 {d['top1']:.2%}" if d.get("top1") else "")

    console.print(f"against {r.reference}: float input {score(r.fp32)}; INT8 {score(r.int8)}"
                  + (" (Q/DQ run in float, as TensorRT computes)" if r.simulated else ""))
    console.print(f"in float: {', '.join(r.unquantized) if r.unquantized else 'no weighted layer'}"
                  + (f"; the {len(r.tail)} nodes after the last weighted layers (the head's decoding)" if r.tail else "")
                  + (f"; every node up to the first and from the last {r.prefix} weighted layers (--max-loss)"
                     if r.prefix else ""))
    for note in r.notes:
        console.print(f"note: {note}")
    console.print(f"{r.calibration_samples} calibration samples, {r.seconds:.0f} s; wrote {output}")


def _fmt(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or '-' if missing."""
    return "-" if value is None else format(value, spec)


def _count(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def format_bench_table(results: Sequence[BenchResult]) -> Table:
    """One row per model; speed-up = first model's median / this median, MAC ratio = MACs / first's MACs."""
    sleeping = results and not results[0].spin
    table = Table(title=f"Latency (onnxruntime{', threads sleeping between nodes' if sleeping else ''})")
    for col in ("model", "provider", "batch"):
        table.add_column(col)
    for col in ("median ms", "p90 ms", "p99 ms", "throughput /s", "MACs", "params", "speed-up", "MAC ratio"):
        table.add_column(col, justify="right")
    base = results[0] if results else None
    for r in results:
        speedup = f"{base.median_ms / r.median_ms:.2f}x" if base and r.median_ms > 0 else "-"
        ratio = f"{r.macs / base.macs:.3f}" if base and base.macs and r.macs is not None else "-"
        table.add_row(
            Path(r.model).name,
            r.provider.removesuffix("ExecutionProvider"),
            str(r.batch),
            f"{r.median_ms:.3f}",
            f"{r.p90_ms:.3f}",
            f"{r.p99_ms:.3f}",
            f"{r.throughput:.1f}",
            _count(r.macs),
            _count(r.params),
            speedup,
            ratio,
        )
    return table

