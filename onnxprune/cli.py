"""Command line: ``onnxprune analyze | compress | sweep | recover | eval | bench | export``.

The flags are declared in ``onnxprune.flags``, which also builds the API's objects from their values;
``onnxprune.tables`` prints the results."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Optional

import onnxruntime
import torch
import typer
import typer.main
from rich.markup import escape

from onnxprune import api, flags
from onnxprune.deploy.export import TensorRTUnavailable
from onnxprune.errors import ModelError, OnnxPruneError, OutputError
from onnxprune.fileio import atomic_write, check_output
from onnxprune.flags import (
    DEFAULT_MEAN, DEFAULT_STD, MACS_HELP, RECOVER, AllocationOpt, BenchOpt, BestEffortOpt, BgrOpt, BlockWindowOpt,
    CalibOpt, CompressBatchOpt, CompressProviderOpt, CostTableOpt, CropOpt, DistillFeaturesOpt, DistillLrOpt,
    DistillSegmentsOpt, DistillStepsOpt, DistillViewsOpt, DrawSeedOpt, EmptySamplesOpt, FlipOpt, GlobalBudgetOpt,
    HeldOpt, HeldSubsetOpt, HoldoutOpt, ImitationTargetOpt, InputShapeOpt, KeepOpt, LatencyBatchOpt,
    LatencyThreadsOpt, LayoutOpt, LimitOpt, LrOpt, MeanOpt, MemoryOpt, MixOpt, PullOpt, QuietOpt, RandomSeedOpt,
    ReconstructOpt, RecoverHeldSubsetOpt, RecoverMethodOpt, RecoverStepsOpt, RecoverTimeOpt, RemoveBlocksOpt,
    ReportOpt, ResidualStreamsOpt, ResizeOpt, RoundToOpt, SaveCostTableOpt, SelectMethodOpt, SpillDirOpt, StdOpt,
    StepsOpt, SubsetOpt, TargetFlopsOpt, TargetLatencyOpt, TargetRatioOpt, TargetsOpt, TaskOpt, TeacherProviderOpt,
    TrainBatchOpt, TrainOpt,
)
from onnxprune.recovery import Progress as RecoveryProgress
from onnxprune.strategies import CompressOptions, Local, Random
from onnxprune.tables import (console, err_console, format_bench_table, format_table, print_analysis, print_compress,
                              print_recovery, print_sweep, progress)
from onnxprune.tasks import CONF, NMS_IOU

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Channel pruning of ONNX CNNs without fine-tuning: greedy channel selection (group OMP by "
                       "default; the local and global imitation of Ye, Wu & Liu, NeurIPS 2020) and a least-squares "
                       "refit of the next layer. "
                  + MACS_HELP)
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



def flag_values(command: str, args: Sequence[str]) -> dict[str, Any]:
    """The values ``command`` receives for the command line ``args`` (its defaults where a flag is absent), keyed by
    its parameter names: how the benchmarks read a flag list without declaring the flags again."""
    click_command = typer.main.get_command(app).commands[command]
    with click_command.make_context(command, list(args)) as ctx:
        return {k: (list(v) or None) if isinstance(v, tuple) else v for k, v in ctx.params.items()}


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
    print_analysis(result, model)


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
    method: SelectMethodOpt = flags.METHOD,
    global_budget: GlobalBudgetOpt = None,
    allocation: AllocationOpt = flags.ALLOCATION,
    target: ImitationTargetOpt = Local.imitate,
    reconstruct: ReconstructOpt = flags.RECONSTRUCT,
    subset: SubsetOpt = None,
    limit: LimitOpt = None,
    flip: FlipOpt = False,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = DEFAULT_MEAN,
    std: StdOpt = DEFAULT_STD,
    layout: LayoutOpt = "auto",
    bgr: BgrOpt = False,
    batch_size: CompressBatchOpt = CompressOptions.batch_size,
    provider: CompressProviderOpt = CompressOptions.provider,
    seed: RandomSeedOpt = Random.seed,
    round_to: RoundToOpt = CompressOptions.round_to,
    recover_steps: RecoverStepsOpt = 0,
    recover_held_subset: RecoverHeldSubsetOpt = None,
    best_effort: BestEffortOpt = False,
    residual_streams: ResidualStreamsOpt = False,
    remove_blocks: RemoveBlocksOpt = False,
    empty_samples: EmptySamplesOpt = False,
    memory: MemoryOpt = None,
    spill_dir: SpillDirOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    task: Annotated[str, typer.Option(
        help="What the output allocation compares: 'auto' (read from the outputs' layout: a detector's class "
             "scores on every anchor plus its boxes, in units of their size, where the original sees an object; a "
             "classifier's KL), a task named as in `eval --task`, or 'raw' (the relative squared error of the raw "
             "output tensors).")] = CompressOptions.task,
    keep: Annotated[Optional[float], typer.Option(
        help="Instead of a --target-*: the cheapest MAC ratio whose task metric against the original, on every "
             "fifth --calib image held out, is at least this (as `sweep --keep`; the candidates are written to "
             "<output>.sweep/).")] = None,
    quiet: QuietOpt = False,
) -> None:
    """Prune channels to a MAC or latency budget and write a smaller ONNX model.

    Dynamic input dims other than the batch need --input-shape; the written model keeps a dynamic batch
    dim and has the other dims fixed to those values. Before it is written, onnxruntime loads it and runs it on
    one calibration sample: a model that fails there is not written."""
    values = dict(locals())
    try:
        if output.resolve() == model.resolve():
            raise OutputError(f"output {output} is the input model: choose another -o path")
        _check_outputs((output, "-o"), (report, "--report"), (save_cost_table, "--save-cost-table"), inputs=[model])
        if keep is not None:
            _compress_keeping(values, quiet)
            return
        job = flags.compress_job(values)
        with progress("compress", quiet) as advance:
            pruned = job.run(advance)
        outcome = pruned if job.recovery is None else _recover(
            lambda on_progress: pruned.recover(job.recovery, held=job.held, on_progress=on_progress), quiet)
        _save(outcome, output, report, refuse=[model])
    except OnnxPruneError as exc:
        _fail(exc)
    print_compress(outcome.report, method, reconstruct, round_to, output)
    if outcome.recovery is not None:
        print_recovery(outcome.recovery)



def _compress_keeping(values: dict[str, Any], quiet: bool) -> None:
    """compress --keep: a sweep's search into <output>.sweep/, its choice copied to -o (and --report)."""
    with progress("compress --keep", quiet) as advance:
        result, chosen, folder = flags.keep(values, advance)
    atomic_write(values["output"], lambda tmp: tmp.write_bytes(Path(chosen.path).read_bytes()))
    if values["report"] is not None:
        data = json.loads(Path(chosen.path).with_suffix(".json").read_text())
        _write_json(values["report"], {**data, "keep": {**result.keep, "reached": chosen.fidelity,
                                                        "judged_on": result.held}})
    print_sweep(result, folder, values["output"])


def torch_threads() -> None:
    """Torch on every core the process may run on, unless OMP_NUM_THREADS sets its threads (torch's default may
    take fewer; the library leaves torch's global settings to its caller)."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(len(os.sched_getaffinity(0)))


def _recover(call: Callable[[RecoveryProgress], api.Result], quiet: bool) -> api.Result:
    """``call(on_progress)`` (a recovery) with a progress bar (segment, step, best held-out loss), torch threads
    as ``torch_threads`` sets them."""
    torch_threads()
    with progress("recover", quiet) as advance:
        def on_progress(label: str, step: int, total: int, held: float | None) -> None:
            advance(step, total, f"{label} (held-out loss {held:.4f})" if held is not None else label)

        return call(on_progress)



@app.command("sweep")
def sweep_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model to prune.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder for the models, their reports, sweep.json "
                                                               "and sweep.png.")],
    calib: CalibOpt,
    targets: TargetsOpt = None,
    held: HeldOpt = None,
    keep: KeepOpt = None,
    method: SelectMethodOpt = flags.METHOD,
    allocation: AllocationOpt = flags.ALLOCATION,
    reconstruct: ReconstructOpt = flags.RECONSTRUCT,
    subset: SubsetOpt = None,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = DEFAULT_MEAN,
    std: StdOpt = DEFAULT_STD,
    layout: LayoutOpt = "auto",
    bgr: BgrOpt = False,
    batch_size: CompressBatchOpt = CompressOptions.batch_size,
    provider: CompressProviderOpt = CompressOptions.provider,
    round_to: RoundToOpt = CompressOptions.round_to,
    memory: MemoryOpt = None,
    input_shape: InputShapeOpt = None,
    task: TaskOpt = CompressOptions.task,
    bench: BenchOpt = True,
    quiet: QuietOpt = False,
) -> None:
    """Compress to several budgets on one calibration and one set of output-allocation probes; judge each model
    on held-out images by the task's metric against the original, time it, and print the trade-off.

    Writes every model and its report to -o, with sweep.json (the table) and sweep.png (fidelity against
    speed-up, the original marked). With --keep, also finds the cheapest budget that keeps the metric."""
    values = dict(locals())
    try:
        if output.exists() and not output.is_dir():
            raise OutputError(f"-o {output} is a file: sweep writes a folder of models")
        with progress("sweep", quiet) as advance:
            result = flags.sweep(values, advance)
    except OnnxPruneError as exc:
        _fail(exc)
    print_sweep(result, output)


@app.command("recover")
def recover_cmd(
    model: Annotated[Path, typer.Argument(help="Pruned ONNX model (the student).")],
    teacher: Annotated[Path, typer.Option(help="The original model it was pruned from.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the recovered model.")],
    calib: CalibOpt,
    method: RecoverMethodOpt = RECOVER.method.value,
    steps: StepsOpt = None,
    lr: LrOpt = RECOVER.lr,
    block_window: BlockWindowOpt = RECOVER.block_window,
    distill_steps: DistillStepsOpt = None,
    distill_lr: DistillLrOpt = RECOVER.distill_lr,
    distill_segments: DistillSegmentsOpt = RECOVER.distill_segments,
    distill_views: DistillViewsOpt = RECOVER.distill_views,
    distill_features: DistillFeaturesOpt = RECOVER.distill_features,
    mix: MixOpt = RECOVER.mix.value,
    holdout: HoldoutOpt = RECOVER.holdout,
    held_subset: HeldSubsetOpt = None,
    train: TrainOpt = RECOVER.train.value,
    pull: PullOpt = RECOVER.pull,
    time: RecoverTimeOpt = None,
    subset: SubsetOpt = None,
    limit: LimitOpt = None,
    flip: FlipOpt = False,
    resize: ResizeOpt = None,
    crop: CropOpt = None,
    mean: MeanOpt = DEFAULT_MEAN,
    std: StdOpt = DEFAULT_STD,
    layout: LayoutOpt = "auto",
    bgr: BgrOpt = False,
    batch_size: TrainBatchOpt = RECOVER.batch_size,
    provider: TeacherProviderOpt = RECOVER.provider,
    seed: DrawSeedOpt = RECOVER.seed,
    memory: MemoryOpt = None,
    spill_dir: SpillDirOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    quiet: QuietOpt = False,
) -> None:
    """Few-shot recovery: block-wise reconstruction, then distillation on augmented images, towards the teacher,
    within 15 minutes by default (--time).

    Never worse: the result is kept only if it is closer to the teacher (KL for classifiers) on the
    held-out calibration samples than the input; otherwise the input is written unchanged."""
    values = dict(locals())
    try:
        if output.resolve() in (model.resolve(), teacher.resolve()):
            raise OutputError(f"output {output} is an input model: choose another -o path")
        _check_outputs((output, "-o"), (report, "--report"), inputs=[model, teacher])
        job = flags.recover_job(values)
        result = _recover(job.run, quiet)
        _save(result, output, report, refuse=[model, teacher])
    except OnnxPruneError as exc:
        _fail(exc)
    print_recovery(result.report)
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
    string agreement of a CTC recogniser, region F1 of a text detector. Top-1, top-5, agreement, KL and a
    detector's mAP come with their spread over the images (± one standard deviation over resamples of them)."""
    values = dict(locals())
    try:
        if not model.is_file():
            raise ModelError(f"{model}: no such file")
        result = flags.evaluate(values)
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
    values = dict(locals())
    try:
        with progress("bench", quiet) as advance:
            results = flags.bench(values, on_round=lambda done, total: advance(done, total, "timing rounds"))
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




def main() -> None:  # pragma: no cover - called by onnxprune.__main__ (the console entry)
    app(prog_name="onnxprune")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
