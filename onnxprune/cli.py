"""Command line: ``onnxprune analyze | compress | recover | eval | bench | export``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import onnx
import onnxruntime
import torch
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onnxprune import api
from onnxprune.api import parse_macs
from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from onnxprune.deploy.bench import BenchResult
from onnxprune.deploy.cost import format_ms, parse_latency
from onnxprune.deploy.export import TensorRTUnavailable
from onnxprune.errors import ModelError, OnnxPruneError, OutputError, TargetError
from onnxprune.evaluation import EvalResult
from onnxprune.fileio import atomic_write, check_output
from onnxprune.pipeline import CompressReport, LatencyReport
from onnxprune.progress import Heartbeat
from onnxprune.tasks import CONF, NMS_IOU
from onnxprune.recovery import Progress as RecoveryProgress, RecoverOptions, RecoverReport
from onnxprune.runtime.store import memory_bytes
from onnxprune.strategies import MACs, Latency, Ratio, named

MACS_HELP = ("MACs count the multiply-accumulates of Conv, ConvTranspose, Gemm and MatMul per sample, the "
             "convention of pruning papers (their 'FLOPs').")

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Channel pruning of ONNX CNNs without fine-tuning: greedy channel selection (group OMP by "
                       "default; the local and global imitation of Ye, Wu & Liu, NeurIPS 2020) and a least-squares "
                       "refit of the next layer. "
                  + MACS_HELP)
console = Console(width=None if sys.stdout.isatty() else 140)  # logs and pipes get readable tables
err_console = Console(stderr=True)
onnxruntime.set_default_logger_severity(3)  # constant folding's sessions warn about harmless graph rewrites


def error_line(error: str | OnnxPruneError) -> str:
    """``error``'s message with the flag of the option at fault (the library names the option, not its flag)."""
    message = str(error)
    option = getattr(error, "option", None)
    if option and f"--{option.replace('_', '-')}" not in message:
        message += f" (--{option.replace('_', '-')})"
    return message


def _fail(error: str | OnnxPruneError) -> None:
    """Print ``error`` as one line on stderr and exit 2."""
    err_console.print(f"[bold red]error:[/] {escape(error_line(error))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _preprocess(model: api.ModelSource, resize: int | None, crop: int | None, mean: str, std: str, layout: str,
                bgr: bool, input_shape: list[str] | None = None) -> Preprocess:
    """The image preprocessing of the flags for ``model`` (see ``api.preprocess_for``)."""
    def floats(text: str) -> tuple[float, ...]:
        try:
            return tuple(float(v) for v in text.split(","))
        except ValueError:
            raise OnnxPruneError(f"cannot read {text!r} as comma-separated numbers (e.g. 0.485,0.456,0.406)") from None

    return api.preprocess_for(model, input_shape=input_shape, resize=resize, crop=crop, mean=floats(mean),
                              std=floats(std), layout=layout, bgr=bgr)


def _calibration(calib: str, model: onnx.ModelProto, preprocess: Preprocess, subset: str | None, limit: int | None,
                 flip: bool, held_subset: str | None) -> tuple[api.CalibrationSet, api.CalibrationSet | None]:
    """The calibration samples of the flags, and the held-out ones of ``held_subset`` (None without it)."""
    data = api.calibration(calib, model, preprocess, subset=subset, limit=limit, flip=flip)
    return data, None if held_subset is None else api.calibration(calib, model, preprocess, subset=held_subset)


def _check_outputs(*outputs: tuple[Path | None, str], inputs: list[Path]) -> None:
    """Every output path the command will write, checked before any work (one-line error naming the flag)."""
    for path, flag in outputs:
        if path is not None:
            check_output(path, inputs, what=f"{flag} file")


def _write_json(path: Path, data: dict) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def _save(result: api.Result, output: Path, report: Path | None, refuse: list[Path]) -> None:
    """The model to ``output`` and, with ``report``, its JSON report."""
    result.save(output, refuse=refuse)
    if report is not None:
        _write_json(report, result.to_dict())


def _mmacs(value: float) -> str:
    return f"{value / 1e6:,.1f}M"


ResizeOpt = Annotated[Optional[int], typer.Option(
    help="Resize the short side of images to this many pixels (default: the crop × 256/224).")]
CropOpt = Annotated[Optional[int], typer.Option(
    help="Centre-crop images to this square size (default: the model input's H,W, after --input-shape; else 224).")]
MeanOpt = Annotated[str, typer.Option(help="Per-channel mean (R,G,B) after scaling to [0,1].")]
StdOpt = Annotated[str, typer.Option(help="Per-channel std (R,G,B).")]
LayoutOpt = Annotated[str, typer.Option(
    help="Input layout: nchw, nhwc, or auto (nhwc when the image input's last dim is 1, 3 or 4 and its second "
         "is not).")]
LimitOpt = Annotated[Optional[int], typer.Option(help="Use at most this many calibration samples.")]
FlipOpt = Annotated[bool, typer.Option("--flip", help="Add each calibration image's mirror.")]
DEFAULT_MEAN = ",".join(map(str, IMAGENET_MEAN))
DEFAULT_STD = ",".join(map(str, IMAGENET_STD))
BgrOpt = Annotated[bool, typer.Option("--bgr", help="Feed channels in BGR order.")]
SubsetOpt = Annotated[Optional[str], typer.Option(
    help="Subset of the sorted image list: 'a:b[:s]' slice, 'k%n' (index mod n == k) or '!k%n' (the rest).")]
InputShapeOpt = Annotated[Optional[list[str]], typer.Option(
    "--input-shape", help="Shape for dynamic inputs: 1x3x224x224, or name:1x3x320x320 per input (repeatable).")]


@app.command("analyze")
def analyze_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    input_shape: InputShapeOpt = None,
) -> None:
    """List the channel groups (prunable or not, with the reason), MACs and parameters.

    Dynamic input dims other than the batch need --input-shape (the MACs depend on them). MACs inside Loop/If/Scan
    bodies are not counted; a line names those nodes."""
    try:
        result = api.analyze(model, input_shape)
    except OnnxPruneError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    table = Table(title=f"{model}: channel groups")
    for col in ("id", "group (first producer)", "channels", "producers", "consumers", "prunable"):
        table.add_column(col)
    for g in result.groups:
        status = (f"[green]yes[/]{' (a removable block)' * (g.id in result.blocks)}" if g.prunable
                  else f"[red]no[/]: {g.reason}")
        table.add_row(str(g.id), g.name, str(g.channels), str(len(g.producers)), str(len(g.consumers)), status)
    console.print(table)
    console.print(f"MACs {_mmacs(result.macs.total)}, params {result.params / 1e6:.2f}M, "
                  f"{len(result.prunable)}/{len(result.groups)} groups prunable, "
                  f"{result.prunable_share():.0%} of MACs touch a prunable group")
    for where in result.uncounted:
        console.print(f"not counted: the MACs inside the subgraph of {where}, which is left as it is")


# ---------------------------------------------------------------- compress

TargetFlopsOpt = Annotated[Optional[str], typer.Option(help="MAC budget, e.g. 245M. " + MACS_HELP)]
TargetRatioOpt = Annotated[Optional[float], typer.Option(help="MAC budget as a fraction of the original.")]
TargetLatencyOpt = Annotated[Optional[str], typer.Option(
    help="Latency budget on --provider at --latency-batch instead of MACs: 3.5ms, 800us, or 0.8x (of the "
         "original's measured latency). Widths are allocated on a per-group cost table timed on this machine; "
         "the written model is then timed against the original.")]
LatencyBatchOpt = Annotated[int, typer.Option(help="Batch size of the latency budget's timings.")]
LatencyThreadsOpt = Annotated[Optional[int], typer.Option(
    help="Intra-op threads of the latency budget's timings (default: onnxruntime's).")]
CostTableOpt = Annotated[Optional[Path], typer.Option(
    help="Reuse a cost table written by --save-cost-table: one measured for another model (graph or weights), "
         "input dims, --provider, --latency-batch or --threads is refused; from another machine, a warning.")]
SaveCostTableOpt = Annotated[Optional[Path], typer.Option(help="Write the measured cost table (JSON) here.")]
SelectMethodOpt = Annotated[str, typer.Option(
    help="Channel selection: 'omp' (default: greedy forward selection of the channels whose refitted "
         "consumers best reproduce the original output, a group orthogonal matching pursuit), 'local' "
         "imitation (the paper's greedy), 'global' imitation of the final output (the paper's second method, "
         "shortlisted: the network's output decides among the OMP's best channels, each candidate refitted; "
         "minutes per model on a CPU), 'auto' (per layer, the better of omp and global on held samples, "
         "global only within --global-budget, the layers nearest the output first), or the baselines 'l1' "
         "and 'random'.")]
GlobalBudgetOpt = Annotated[Optional[float], typer.Option(
    help="With --method auto: seconds global imitation may take in all (default 300); each layer's cost is "
         "predicted, a search stops when its share is spent, and the output lists which method won each layer "
         "and why.")]
AllocationOpt = Annotated[str, typer.Option(
    help="Per-layer widths: 'output' (default; judged on the network's output: each layer alone pruned to "
         "75/50/25% on 64 calibration samples, the output's discrepancy (see --task) measured on up to 32 "
         "others, fewer where probing would cost more than 4 forward passes of the calibration set; the "
         "budget goes where the output degrades least per MAC saved, each layer ≥ 25%), 'epsilon' (one "
         "threshold on every layer's relative imitation loss, the paper's rule, searched to meet the budget), "
         "'uniform' keep ratio, or 'curve' (greedy on the local error curves, each layer ≥ 25%).")]
ImitationTargetOpt = Annotated[str, typer.Option(
    help="Imitation target: 'original' (the original network's layer output, corrects earlier layers' "
         "error) or 'paper' (the layer's own output on the pruned prefix).")]
ReconstructOpt = Annotated[str, typer.Option(
    help="Consumer weights after selection: 'full' least-squares refit, per-channel 'scale', or 'none' "
         "(the paper's N·a_i fold).")]
CompressBatchOpt = Annotated[int, typer.Option(help="Samples per onnxruntime/statistics batch.")]
CompressProviderOpt = Annotated[str, typer.Option(help="Execution provider: auto, cpu, cuda.")]
RandomSeedOpt = Annotated[int, typer.Option(help="Seed for the random baseline.")]
RoundToOpt = Annotated[int, typer.Option(
    help="Keep every pruned width a multiple of this (vector units and tensor cores lose their speed on odd "
         "widths; 1 = any width). A group narrower than 4× this uses the largest power of two up to a quarter "
         "of its channels instead, so that it can still be pruned (the output lists such groups).")]
RecoverStepsOpt = Annotated[int, typer.Option(
    help="After pruning, run `recover` with its defaults (block-wise reconstruction with this many steps per "
         "changed segment, then distillation) towards the input model; 0 = no recovery. Its held-out samples "
         "are a split of the calibration set the pruner fitted, so the never-worse check is optimistic, unless "
         "--recover-held-subset gives samples the pruner does not see.")]
RecoverHeldSubsetOpt = Annotated[Optional[str], typer.Option(
    help="With --recover-steps: these samples of the --calib source (same syntax as --subset; keep them out of "
         "--subset) pick the recovery's checkpoints and judge it, instead of a split of the calibration set.")]
BestEffortOpt = Annotated[bool, typer.Option(
    "--best-effort", help="If the budget is below the lowest reachable MACs, prune to those instead of failing.")]
ResidualStreamsOpt = Annotated[bool, typer.Option(
    "--residual-streams/--no-residual-streams",
    help="Also prune residual streams (the channels that several blocks sum with Add, e.g. MobileNetV2's stage "
         "outputs), each jointly across all its producers and consumers, probed by the output allocation as any "
         "group is; off by default.")]
RemoveBlocksOpt = Annotated[bool, typer.Option(
    "--remove-blocks/--no-remove-blocks",
    help="Let the output allocation also remove whole residual blocks (a block whose inner channels feed one "
         "Conv into the residual Add, e.g. MobileNetV2's inverted residuals with a shortcut, ResNet's basic "
         "blocks): probed like a width, the block becomes its shortcut plus a fitted constant, and the later "
         "layers' refits absorb it.")]
MemoryOpt = Annotated[Optional[str], typer.Option(
    help="RAM for the cached activations of the calibration set (e.g. 4G, 512M); past it they are spilled to "
         "--spill-dir and read back by ranges. Default: half of the memory available at the start. The written "
         "model does not depend on it.")]
SpillDirOpt = Annotated[Optional[Path], typer.Option(
    help="Folder for spilled activations (default: the system's temporary folder); the files are unlinked as "
         "soon as they are open, so nothing is left behind.")]
TaskOpt = Annotated[str, typer.Option(
    help="How the outputs are read: 'auto' (from their layout), 'classify', 'detect' (YOLOv5/v8/v11, YOLOX, "
         "PicoDet/PP-YOLOE score and box outputs), 'segment' (a YOLO mask head), 'ctc' (a text recogniser), "
         "'seq' (an attention decoder's [N, L, classes] token scores, L varying; the last class ends a sequence), "
         "'textdet' (a text detector's probability map) or 'raw' (the tensors as they are).")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress on stderr (by default: a bar on a terminal, else a plain line at least "
                          "every 10 s: the phase, the step, the time spent and an estimate of what is left).")]
ReportOpt = Annotated[Optional[Path], typer.Option(help="Write a JSON report here.")]
CalibOpt = Annotated[str, typer.Option(help="Calibration data: image folder, .npy/.npz, or file.py:fn.")]


@app.command("compress")
def compress_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model to prune.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the pruned model.")],
    calib: CalibOpt,
    target_flops: TargetFlopsOpt = None,
    target_ratio: TargetRatioOpt = None,
    target_latency: TargetLatencyOpt = None,
    latency_batch: LatencyBatchOpt = 1,
    threads: LatencyThreadsOpt = None,
    cost_table: CostTableOpt = None,
    save_cost_table: SaveCostTableOpt = None,
    method: SelectMethodOpt = "omp",
    global_budget: GlobalBudgetOpt = None,
    allocation: AllocationOpt = "output",
    target: ImitationTargetOpt = "original",
    reconstruct: ReconstructOpt = "full",
    subset: SubsetOpt = None,
    limit: LimitOpt = None,
    flip: FlipOpt = False,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = DEFAULT_MEAN,
    std: StdOpt = DEFAULT_STD,
    layout: LayoutOpt = "auto",
    bgr: BgrOpt = False,
    batch_size: CompressBatchOpt = 32,
    provider: CompressProviderOpt = "auto",
    seed: RandomSeedOpt = 0,
    round_to: RoundToOpt = 8,
    recover_steps: RecoverStepsOpt = 0,
    recover_held_subset: RecoverHeldSubsetOpt = None,
    best_effort: BestEffortOpt = False,
    residual_streams: ResidualStreamsOpt = False,
    remove_blocks: RemoveBlocksOpt = False,
    memory: MemoryOpt = None,
    spill_dir: SpillDirOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    task: Annotated[str, typer.Option(
        help="What the output allocation compares: 'auto' (read from the outputs' layout: a detector's class "
             "scores on every anchor plus its boxes, in units of their size, where the original sees an object; a "
             "classifier's KL), a task named as in `eval --task`, or 'raw' (the relative squared error of the raw "
             "output tensors).")] = "auto",
    quiet: QuietOpt = False,
) -> None:
    """Prune channels to a MAC or latency budget and write a smaller ONNX model.

    Dynamic input dims other than the batch need --input-shape; the written model keeps a dynamic batch
    dim and has the other dims fixed to those values. Before it is written, onnxruntime loads it and runs it on
    one calibration sample: a model that fails there is not written."""
    try:
        if output.resolve() == model.resolve():
            raise OutputError(f"output {output} is the input model: choose another -o path")
        _check_outputs((output, "-o"), (report, "--report"), (save_cost_table, "--save-cost-table"), inputs=[model])
        budget = _budget(target_flops, target_ratio, target_latency, latency_batch, threads, cost_table,
                         save_cost_table)
        if recover_held_subset is not None and recover_steps < 1:
            raise OnnxPruneError("--recover-held-subset goes with --recover-steps N (N ≥ 1)")
        select, allocate, refit = named(method, allocation, reconstruct, target, seed, remove_blocks, global_budget)
        onnx_model = api.load(model, input_shape)
        preprocess = _preprocess(onnx_model, resize, crop, mean, std, layout, bgr)
        data, held = _calibration(calib, onnx_model, preprocess, subset, limit, flip, recover_held_subset)
        with _progress("compress", quiet) as advance:
            pruned = api.compress(onnx_model, data, budget=budget, select=select, allocate=allocate,
                                   reconstruct=refit, preprocess=preprocess, round_to=round_to,
                                   batch_size=batch_size, provider=provider, best_effort=best_effort,
                                   residual_streams=residual_streams, memory=memory, spill_dir=spill_dir,
                                   task=task, on_layer=advance)
        outcome = pruned if recover_steps < 1 else _recover(lambda on_progress: pruned.recover(
            RecoverOptions(steps=recover_steps, batch_size=batch_size, provider=provider, seed=seed,
                           memory=memory_bytes(memory), spill_dir=spill_dir and str(spill_dir)), held=held,
            on_progress=on_progress), quiet)
        _save(outcome, output, report, refuse=[model])
    except OnnxPruneError as exc:
        _fail(exc)
    _print_compress(outcome.report, method, reconstruct, round_to, output)
    if outcome.recovery is not None:
        _print_recovery(outcome.recovery)


def _budget(target_flops: str | None, target_ratio: float | None, target_latency: str | None, latency_batch: int,
            threads: int | None, cost_table: Path | None, save_cost_table: Path | None) -> MACs | Ratio | Latency:
    """The budget of compress's target flags (exactly one of them)."""
    if [target_flops, target_ratio, target_latency].count(None) != 2:
        raise TargetError("give exactly one of --target-flops (e.g. 245M), --target-ratio (e.g. 0.8) or "
                          "--target-latency (e.g. 3.5ms or 0.8x)")
    if (cost_table or save_cost_table) and not target_latency:
        raise TargetError("--cost-table and --save-cost-table go with --target-latency")
    if target_flops:
        return MACs(parse_macs(target_flops))
    if target_ratio is not None:
        return Ratio(target_ratio)
    latency_ms, latency_ratio = parse_latency(target_latency)
    return Latency(latency_ms, latency_ratio, latency_batch, threads, cost_table and str(cost_table),
                   save_cost_table and str(save_cost_table))


@contextmanager
def _progress(description: str, quiet: bool = False) -> Iterator[Callable[[int, int, str], None]]:
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


def _print_compress(result: CompressReport, method: str, reconstruct: str, round_to: int, output: Path) -> None:
    table = Table(title=f"pruned {len(result.layers)} groups ({method}, reconstruct={reconstruct})")
    chosen = any(layer.selection for layer in result.layers)
    for col in ("group", "kept", *(("selected by",) * chosen), "greedy loss", "error (fold)", "error", "s"):
        table.add_column(col)
    for layer in result.layers:
        greedy = "-" if layer.imitation_loss is None else f"{layer.imitation_loss:.3f}"
        kept = f"{layer.kept}/{layer.channels}" if layer.kept else f"block removed (0/{layer.channels})"
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
    finer = [layer for layer in result.layers if layer.step < round_to]
    if finer:
        console.print(f"{len(finer)} groups narrower than {4 * round_to} channels were cut in finer steps than "
                      f"--round-to {round_to}: " + ", ".join(f"{x.group} ({x.kept}/{x.channels}, step {x.step})"
                                                              for x in finer))
    if result.written_batch is not None:
        console.print(f"the input fixes the batch ({result.written_batch['reason']}) and nothing in the graph does: "
                      f"calibration batched samples through a copy with a free batch; the written model keeps batch "
                      f"{result.written_batch['size']}")
    if result.fixed_batch is not None:
        console.print(f"the graph fixes its batch ({result.fixed_batch['reason']}): calibration ran "
                      f"{result.fixed_batch['size']} sample(s) at a time")
    if result.requested_macs is not None:
        console.print(f"--best-effort: the budget of {_mmacs(result.requested_macs)} MACs is below the lowest "
                      f"reachable {_mmacs(result.target_macs)}: pruned to the lowest reachable MACs instead")
    if result.latency is not None:
        _print_latency(result.latency)
    console.print(
        f"MACs {_mmacs(result.macs_before)} → {_mmacs(result.macs_after)} "
        f"({result.macs_after / result.macs_before:.1%}), params {result.params_before / 1e6:.2f}M → "
        f"{result.params_after / 1e6:.2f}M, {result.calibration_samples} calibration samples, "
        f"{result.seconds:.1f}s on {result.provider}; wrote {output}"
    )


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


# ---------------------------------------------------------------- recover


def _recover(call: Callable[[RecoveryProgress], api.Result], quiet: bool) -> api.Result:
    """``call(on_progress)`` (a recovery) with a progress bar (segment, step, best held-out loss), torch on every
    core of the process (its default may take fewer; the library leaves torch's global settings to its caller)."""
    torch.set_num_threads(os.cpu_count() or 1)
    with _progress("recover", quiet) as advance:
        def on_progress(label: str, step: int, total: int, held: float | None) -> None:
            advance(step, total, f"{label} (held-out loss {held:.4f})" if held is not None else label)

        return call(on_progress)


def _print_recovery(r: RecoverReport) -> None:
    table = Table(title=f"recovery ({r.options['method']}): {len(r.segments)} segments trained")
    for col in ("stage", "params", "held-out loss before", "after", "best step", "s"):
        table.add_column(col)
    for seg in r.segments:
        table.add_row(f"block → {seg.end[0]}", f"{seg.parameters:,}", f"{seg.held_before:.4f}",
                      f"{seg.held_after:.4f}", str(seg.best_step), f"{seg.seconds:.1f}")
    if r.distill is not None:
        d = r.distill
        part = "whole model" if d.whole_model else f"from {d.trained_from[0]}"
        table.add_row(f"distill ({part}; {d.samples:,} samples: {d.augment})", f"{d.parameters:,}",
                      f"{d.held_before:.4f}", f"{d.held_after:.4f}", str(d.best_step), f"{d.seconds:.1f}")
    console.print(table)
    agree = (f", agreement {r.agreement_before:.1%} → {r.agreement_after:.1%}"
             if r.agreement_before is not None and r.agreement_after is not None else "")
    verdict = ("kept the recovered weights" if r.improved else
               "the recovered weights were not better on the held-out samples: returned the input model unchanged")
    held = "given apart" if r.held_unseen else "split off the calibration set"
    picked = r.samples_held - r.samples_verdict
    console.print(f"held-out {r.metric} {r.before:.4f} → {r.after:.4f}{agree} on {r.samples_verdict} of "
                  f"{r.samples_held} held-out samples (the other {picked} picked the checkpoints; {held}; "
                  f"{r.samples_train} trained on), {r.seconds:.1f}s: {verdict}")


RecoverMethodOpt = Annotated[str, typer.Option(
    help="'block' reconstruction (each changed segment trained to reproduce the teacher's tensor at its end), "
         "'distill'ation of the outputs on augmented images (both models see the same crop/flip/mix), or "
         "'block+distill' (default: both, in this order).")]
StepsOpt = Annotated[int, typer.Option(help="Block stage: Adam steps per segment whose weights differ from the "
                                            "teacher's.")]
LrOpt = Annotated[float, typer.Option(help="Block stage: Adam learning rate (cosine decay).")]
DistillStepsOpt = Annotated[int, typer.Option(help="Distill stage: Adam steps.")]
DistillLrOpt = Annotated[float, typer.Option(help="Distill stage: Adam learning rate (cosine decay).")]
DistillSegmentsOpt = Annotated[int, typer.Option(
    help="Distill stage: train only the last N segments (the head), on their inputs cached for "
         "--distill-views augmented views of every training sample; 0 = the whole model, augmented on the fly "
         "(slow on CPU).")]
DistillViewsOpt = Annotated[int, typer.Option(
    help="Distill stage: augmented views per training sample cached for the head.")]
MixOpt = Annotated[str, typer.Option(
    help="Distill stage: 'mixup', 'cutmix' or 'none', after random resized crop and flip.")]
HoldoutOpt = Annotated[float, typer.Option(
    help="Fraction of the calibration samples held out: half pick each stage's checkpoint, the other half "
         "judge the result.")]
HeldSubsetOpt = Annotated[Optional[str], typer.Option(
    help="Instead of --holdout: these samples of the --calib source (same syntax as --subset), split in two "
         "halves as with --holdout, pick checkpoints and judge the result, and every --subset sample trains. "
         "Give samples the pruner did not see: on its own calibration samples a pruned model looks better than "
         "it is.")]
TrainOpt = Annotated[str, typer.Option(
    help="What to train in a changed segment: 'segment' (every weight in it) or 'changed' (only the "
         "weights pruning changed).")]
PullOpt = Annotated[float, typer.Option(help="Weight decay towards the starting weights (relative).")]
TrainBatchOpt = Annotated[int, typer.Option(help="Training batch size.")]
TeacherProviderOpt = Annotated[str, typer.Option(help="Execution provider for the teacher: auto, cpu, cuda.")]
DrawSeedOpt = Annotated[int, typer.Option(help="Seed of the mini-batch draws.")]


@app.command("recover")
def recover_cmd(
    model: Annotated[Path, typer.Argument(help="Pruned ONNX model (the student).")],
    teacher: Annotated[Path, typer.Option(help="The original model it was pruned from.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the recovered model.")],
    calib: CalibOpt,
    method: RecoverMethodOpt = "block+distill",
    steps: StepsOpt = 200,
    lr: LrOpt = 1e-3,
    distill_steps: DistillStepsOpt = 600,
    distill_lr: DistillLrOpt = 1e-4,
    distill_segments: DistillSegmentsOpt = 2,
    distill_views: DistillViewsOpt = 8,
    mix: MixOpt = "mixup",
    holdout: HoldoutOpt = 0.2,
    held_subset: HeldSubsetOpt = None,
    train: TrainOpt = "segment",
    pull: PullOpt = 0.0,
    subset: SubsetOpt = None,
    limit: LimitOpt = None,
    flip: FlipOpt = False,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = DEFAULT_MEAN,
    std: StdOpt = DEFAULT_STD,
    layout: LayoutOpt = "auto",
    bgr: BgrOpt = False,
    batch_size: TrainBatchOpt = 32,
    provider: TeacherProviderOpt = "auto",
    seed: DrawSeedOpt = 0,
    memory: MemoryOpt = None,
    spill_dir: SpillDirOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Few-shot recovery: block-wise reconstruction, then distillation on augmented images, towards the teacher.

    Never worse: the result is kept only if it is closer to the teacher (KL for classifiers) on the
    held-out calibration samples than the input; otherwise the input is written unchanged."""
    try:
        if output.resolve() in (model.resolve(), teacher.resolve()):
            raise OutputError(f"output {output} is an input model: choose another -o path")
        _check_outputs((output, "-o"), (report, "--report"), inputs=[model, teacher])
        student, teacher_model = api.load(model, input_shape), api.load(teacher, input_shape)
        preprocess = _preprocess(teacher_model, resize, crop, mean, std, layout, bgr)
        options = RecoverOptions(method=method, steps=steps, lr=lr, distill_steps=distill_steps, distill_lr=distill_lr,
                                 distill_segments=distill_segments, distill_views=distill_views,
                                 mix=mix, layout=preprocess.layout, batch_size=batch_size, holdout=holdout,
                                 train=train, pull=pull, seed=seed, provider=provider, memory=memory_bytes(memory),
                                 spill_dir=spill_dir and str(spill_dir))
        data, held = _calibration(calib, teacher_model, preprocess, subset, limit, flip, held_subset)
        result = _recover(lambda on_progress: api.recover(student, teacher_model, data, options=options, held=held,
                                                          on_progress=on_progress), quiet)
        _save(result, output, report, refuse=[model, teacher])
    except OnnxPruneError as exc:
        _fail(exc)
    _print_recovery(result.report)
    console.print(f"wrote {output}")


# ---------------------------------------------------------------- eval, bench, export


@app.command("eval")
def eval_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model to evaluate.")],
    images: Annotated[Path, typer.Option(help="Image folder; a leading number in a file name is its class.")],
    ref: Annotated[Optional[Path], typer.Option(help="Reference model for agreement / KL / output error.")] = None,
    subset: SubsetOpt = None,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = DEFAULT_MEAN,
    std: StdOpt = DEFAULT_STD,
    layout: LayoutOpt = "auto",
    bgr: BgrOpt = False,
    provider: Annotated[str, typer.Option(help="Execution provider: auto, cpu, cuda.")] = "auto",
    input_shape: InputShapeOpt = None,
    task: TaskOpt = "auto",
    conf: Annotated[float, typer.Option(
        help="Detectors: a detection counts from this score (the reference's detections are the ground truth "
             "of mAP against --ref).")] = CONF,
    iou: Annotated[float, typer.Option(help="Detectors: IoU of the non-maximum suppression.")] = NMS_IOU,
    labels: Annotated[Optional[Path], typer.Option(
        help="Detectors: ground-truth boxes, a folder of YOLO .txt files named as the images or a COCO .json; "
             "adds mAP against them.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Top-1/top-5 from file-name labels, agreement/KL/output error against --ref, and the task's metrics:
    mAP50 and mAP50-95 of a detector against --ref's detections (and --labels), mask IoU of a segmenter,
    string agreement of a CTC recogniser, region F1 of a text detector."""
    try:
        if not model.is_file():
            raise ModelError(f"{model}: no such file")
        preprocess = _preprocess(model, resize, crop, mean, std, layout, bgr, input_shape)
        result = api.evaluate(model, images, ref, preprocess=preprocess, subset=subset, provider=provider, task=task,
                              conf=conf, iou=iou, truth=labels)
    except OnnxPruneError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        console.print(format_table({str(model): result}))


@app.command("bench")
def bench_cmd(
    models: Annotated[list[Path], typer.Argument(help="ONNX models; the first is the baseline of the speed-up.")],
    provider: Annotated[str, typer.Option(help="Execution provider: auto (best available), cpu, cuda, tensorrt.")] = "auto",
    batch: Annotated[int, typer.Option(help="Batch size.")] = 1,
    threads: Annotated[Optional[int], typer.Option(help="Intra-op threads (default: onnxruntime's).")] = None,
    spin: Annotated[bool, typer.Option(
        "--spin/--no-spin", help="The threads busy-wait between a run's nodes (onnxruntime's default, as deployed), "
                                 "or sleep (a CPU shared with other work).")] = True,
    warmup: Annotated[int, typer.Option(help="Untimed runs first.")] = 10,
    runs: Annotated[int, typer.Option(help="Timed runs.")] = 50,
    input_shape: InputShapeOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    quiet: QuietOpt = False,
) -> None:
    """Latency (median/p90/p99) and throughput with onnxruntime, side by side with MACs and params.

    The models take turns, each timed in blocks of back-to-back runs (about 50 ms after an untimed run)."""
    try:
        with _progress("bench", quiet) as advance:
            results = api.bench(models, provider=provider, batch=batch, threads=threads, spin=spin, warmup=warmup,
                                runs=runs, input_shape=input_shape,
                                on_round=lambda done, total: advance(done, total, "timing rounds"))
    except OnnxPruneError as exc:
        _fail(exc)
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        console.print(format_bench_table(results))


@app.command("export")
def export_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model.")],
    output: Annotated[Path, typer.Option(
        "-o", "--output", help="Engine path (model.engine); the TensorRT-ready ONNX is written beside it "
                               "(model.trt.onnx).")],
    tensorrt: Annotated[bool, typer.Option(
        "--tensorrt/--no-tensorrt", help="Build and time the TensorRT engine (needs the tensorrt package), or only "
                                         "write the TensorRT-ready ONNX and print the trtexec command that builds "
                                         "the engine where TensorRT is (e.g. on the Jetson).")] = True,
    fp16: Annotated[bool, typer.Option("--fp16", help="Allow fp16 kernels.")] = False,
    workspace: Annotated[int, typer.Option(help="Builder workspace in MiB.")] = 1024,
    input_shape: InputShapeOpt = None,
) -> None:
    """Write a TensorRT-ready ONNX (static shapes, constants folded), then build a TensorRT engine and time it.

    Without the tensorrt package, --tensorrt (the default) is an error that writes nothing.

    --no-tensorrt writes only the TensorRT-ready ONNX and prints the trtexec command that builds the engine."""
    try:
        _check_outputs((output if tensorrt else None, "-o"), (output.with_suffix(".trt.onnx"), "TensorRT-ready ONNX"),
                       inputs=[model])
        if tensorrt and not api.have_tensorrt():
            raise TensorRTUnavailable("TensorRT is not installed (pip install onnxprune[tensorrt]): add --no-tensorrt "
                                      "to write only the TensorRT-ready ONNX and the trtexec command that builds "
                                      "the engine on a machine with TensorRT")
        exported = api.export(model, output, tensorrt=tensorrt, fp16=fp16, workspace=workspace, input_shape=input_shape)
    except OnnxPruneError as exc:
        _fail(exc)
    # plain print: the paths and the command are copied as they are (no markup, no wrapping)
    print(f"TensorRT-ready ONNX written to {exported.onnx}")
    if exported.trtexec is not None:
        print("no engine built (--no-tensorrt); build it where TensorRT is installed with:")
        print(exported.trtexec)
        return
    print(f"TensorRT engine written to {output}")
    if exported.untimed is not None:
        err_console.print(f"[bold yellow]warning:[/] the engine is not timed: {escape(exported.untimed)}",
                          highlight=False, soft_wrap=True)
    else:
        console.print_json(json.dumps(exported.timing))


# ---------------------------------------------------------------- tables (rich stays in the CLI)


def format_table(results: dict[str, EvalResult]) -> Table:
    """A rich table with one row per model (keyed by its label) and one column per metric."""
    outputs = list(dict.fromkeys(name for r in results.values() for name in r.rel_l2))
    tasks = sorted({r.task for r in results.values() if r.task})
    table = Table(title=f"Fidelity ({', '.join(tasks)})" if tasks else "Fidelity")
    for header in ("model", "images", "top-1", "top-5", "agree", "KL"):
        table.add_column(header, justify="left" if header == "model" else "right")
    for name in outputs:
        suffix = f" {name}" if len(outputs) > 1 else ""
        table.add_column(f"rel-L2{suffix}", justify="right")
        table.add_column(f"cos{suffix}", justify="right")
    metrics = list(dict.fromkeys(name for r in results.values() for name in r.metrics))
    for name in metrics:
        table.add_column(name, justify="right")
    for label, r in results.items():
        row = [label, str(r.images), _fmt(r.top1, ".2%"), _fmt(r.top5, ".2%"), _fmt(r.agreement, ".2%"),
               _fmt(r.kl, ".4g")]
        for name in outputs:
            row += [_fmt(r.rel_l2.get(name), ".4g"), _fmt(r.cosine.get(name), ".5f")]
        row += [_fmt(r.metrics.get(name), ".4g") for name in metrics]
        table.add_row(*row)
    padded = sorted({name for r in results.values() for name in r.padded})
    if padded:
        table.caption = (f"{', '.join(padded)}: length varies from image to image; compared zero-padded to the "
                         "longer of the two")
    return table


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


def main() -> None:  # pragma: no cover - console entry for `python -m onnxprune`
    app(prog_name="onnxprune")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
