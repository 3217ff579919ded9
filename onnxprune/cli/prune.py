"""The pruning commands: ``analyze``, ``compress``, ``sweep``, ``recover``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import typer.main

from onnxprune import api
from onnxprune.flags import jobs
from onnxprune.cli.app import app, check_outputs, fail, save, torch_threads, write_json
from onnxprune.errors import OnnxPruneError, OutputError
from onnxprune.fileio import atomic_write
from onnxprune.flags.declared import (
    METHOD, RECONSTRUCT, RECOVER, AllocationOpt, AverageOpt, BenchOpt, BestEffortOpt, BlockWindowOpt,
    CalibOpt, ColourOpt, CompressBatchOpt, CompressFlipOpt, CompressProviderOpt, CostTableOpt, DistillFeaturesOpt,
    DistillLrOpt, DistillSegmentsOpt, DistillStepsOpt, DistillViewsOpt, DrawSeedOpt, EmptySamplesOpt, FlipOpt,
    GlobalBudgetOpt, HeldOpt, HeldSubsetOpt, HoldoutOpt, ImitationTargetOpt, InputShapeOpt, KeepOpt, LatencyBatchOpt,
    LatencyThreadsOpt, LeavesOpt, LimitOpt, LrOpt, ManifestOpt, MemoryOpt, MixOpt, MosaicOpt, OptimizerOpt, PoolOpt,
    PullOpt, QuietOpt, RandomSeedOpt, ReconstructOpt, RecoverHeldSubsetOpt, RecoverMethodOpt, RecoverStepsOpt,
    RecoverTimeOpt, RemoveBlocksOpt, ReportOpt, ResidualStreamsOpt, RoundToOpt, SaveCostTableOpt, SelectMethodOpt,
    SpillDirOpt, SteerOpt, StepsOpt, SubsetOpt, TargetFlopsOpt, TargetLatencyOpt, TargetRatioOpt, TargetsOpt, TaskOpt,
    TeacherProviderOpt, TemperatureOpt, TrainBatchOpt, TrainOpt, WholeShareOpt, images,
)
from onnxprune.deploy.quantize import QuantizeOptions, int8_path
from onnxprune.flags.deploy import Int8Opt, MaxLossOpt, RuntimeOpt
from onnxprune.recovery import Progress as RecoveryProgress
from onnxprune.torch import save_manifest
from onnxprune.strategies import CompressOptions, Local, Random
from onnxprune.tables import (console, print_analysis, print_compress, print_quantize, print_recovery, print_sweep,
                              progress)


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
        fail(exc)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2))
        return
    print_analysis(result, model)


@app.command("compress")
@images
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
    method: SelectMethodOpt = METHOD,
    global_budget: GlobalBudgetOpt = None,
    allocation: AllocationOpt = None,
    target: ImitationTargetOpt = Local.imitate,
    reconstruct: ReconstructOpt = RECONSTRUCT,
    subset: SubsetOpt = None,
    limit: LimitOpt = None,
    flip: CompressFlipOpt = None,
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
    manifest: ManifestOpt = None,
    task: Annotated[str, typer.Option(
        help="What the output allocation compares: 'auto' (read from the outputs' layout: a detector's class "
             "scores on every anchor plus its boxes, in units of their size, where the original sees an object; a "
             "classifier's KL), a task named as in `eval --task`, or 'raw' (the relative squared error of the raw "
             "output tensors).")] = CompressOptions.task,
    keep: Annotated[Optional[float], typer.Option(
        help="Instead of a --target-*: the cheapest MAC ratio whose task metric against the original, on every "
             "fifth --calib image held out, is at least this (as `sweep --keep`; the candidates are written to "
             "<output>.sweep/).")] = None,
    int8: Int8Opt = False,
    runtime: RuntimeOpt = QuantizeOptions.runtime,
    max_loss: MaxLossOpt = None,
    quiet: QuietOpt = False,
    **image_flags: Any,
) -> None:
    """Prune channels to a MAC or latency budget and write a smaller ONNX model.

    Dynamic input dims other than the batch need --input-shape; the written model keeps a dynamic batch
    dim and has the other dims fixed to those values. Before it is written, onnxruntime loads it and runs it on
    one calibration sample: a model that fails there is not written."""
    values = dict(locals(), **image_flags)
    try:
        if output.resolve() == model.resolve():
            raise OutputError(f"output {output} is the input model: choose another -o path")
        quantized_path = int8_path(output) if int8 else None
        check_outputs((output, "-o"), (report, "--report"), (save_cost_table, "--save-cost-table"),
                      (quantized_path, "INT8 model"), (manifest, "--manifest"), inputs=[model])
        if keep is not None:
            if manifest is not None:
                raise OutputError("--manifest goes with a --target-*: with --keep, run compress again at the ratio "
                                  "it chose")
            _compress_keeping(values, quiet)
            return
        job = jobs.compress_job(values)
        with progress("compress", quiet) as advance:
            pruned = job.run(advance)
        outcome = pruned if job.recovery is None else _recover(
            lambda on_progress: pruned.recover(job.recovery, held=job.held, on_progress=on_progress), quiet)
        save(outcome, output, report, refuse=[model])
        if manifest is not None:
            save_manifest(outcome.manifest(), manifest)
        quantized = None
        if quantized_path is not None:
            with progress("quantize", quiet) as advance:
                quantized, _ = outcome.quantize_beside(output, job.int8, refuse=[model], on_step=advance)
            quantized.report.reference = str(model)
            if report is not None:
                write_json(report, {**outcome.to_dict(), "int8": {"path": str(quantized_path),
                                                                   **quantized.report.to_dict()}})
    except OnnxPruneError as exc:
        fail(exc)
    print_compress(outcome.report, method, jobs.allocation(values), reconstruct, round_to, output)
    if outcome.recovery is not None:
        print_recovery(outcome.recovery)
    if quantized is not None:
        print_quantize(quantized.report, quantized_path)



def _compress_keeping(values: dict[str, Any], quiet: bool) -> None:
    """compress --keep: a sweep's search into <output>.sweep/, its choice copied to -o (and --report)."""
    with progress("compress --keep", quiet) as advance:
        result, chosen, folder = jobs.keep(values, advance)
    atomic_write(values["output"], lambda tmp: tmp.write_bytes(Path(chosen.path).read_bytes()))
    if chosen.int8 is not None:
        atomic_write(int8_path(values["output"]), lambda tmp: tmp.write_bytes(Path(chosen.int8.path).read_bytes()))
    if values["report"] is not None:
        data = json.loads(Path(chosen.path).with_suffix(".json").read_text())
        written = chosen.written
        write_json(values["report"], {**data, "keep": {**result.keep, "reached": written.fidelity,
                                                        "spread": written.spread, "lower": written.lower,
                                                        "int8": chosen.int8 is not None, "judged_on": result.held}})
    print_sweep(result, folder, values["output"])


def _recover(call: Callable[[RecoveryProgress], api.Result], quiet: bool) -> api.Result:
    """``call(on_progress)`` (a recovery) with a progress bar (segment, step, best held-out loss), torch threads
    as ``torch_threads`` sets them."""
    torch_threads()
    with progress("recover", quiet) as advance:
        def on_progress(label: str, step: int, total: int, held: float | None) -> None:
            advance(step, total, f"{label} (held-out loss {held:.4f})" if held is not None else label)

        return call(on_progress)



@app.command("sweep")
@images
def sweep_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model to prune.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder for the models, their reports, sweep.json "
                                                               "and sweep.png.")],
    calib: CalibOpt,
    targets: TargetsOpt = None,
    held: HeldOpt = None,
    keep: KeepOpt = None,
    method: SelectMethodOpt = METHOD,
    allocation: AllocationOpt = None,
    reconstruct: ReconstructOpt = RECONSTRUCT,
    subset: SubsetOpt = None,
    flip: CompressFlipOpt = None,
    batch_size: CompressBatchOpt = CompressOptions.batch_size,
    provider: CompressProviderOpt = CompressOptions.provider,
    round_to: RoundToOpt = CompressOptions.round_to,
    memory: MemoryOpt = None,
    input_shape: InputShapeOpt = None,
    task: TaskOpt = CompressOptions.task,
    bench: BenchOpt = True,
    int8: Annotated[bool, typer.Option(
        "--int8", help="Also quantize every budget's model to INT8 (as `quantize`, choosing on a split of the "
                       "calibration images), judge and time it the same way: the table and the picture show both; "
                       "--keep then judges the INT8 models.")] = False,
    runtime: RuntimeOpt = QuantizeOptions.runtime,
    max_loss: MaxLossOpt = None,
    quiet: QuietOpt = False,
    **image_flags: Any,
) -> None:
    """Compress to several budgets on one calibration and one set of output-allocation probes; judge each model
    on held-out images by the task's metric against the original, time it, and print the trade-off.

    Writes every model and its report to -o, with sweep.json (the table) and sweep.png (fidelity against
    speed-up, the original marked). With --keep, also finds the cheapest budget that keeps the metric."""
    values = dict(locals(), **image_flags)
    try:
        if output.exists() and not output.is_dir():
            raise OutputError(f"-o {output} is a file: sweep writes a folder of models")
        with progress("sweep", quiet) as advance:
            result = jobs.sweep(values, advance)
    except OnnxPruneError as exc:
        fail(exc)
    print_sweep(result, output)


@app.command("recover")
@images
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
    colour: ColourOpt = RECOVER.colour,
    mosaic: MosaicOpt = RECOVER.mosaic,
    leaves: LeavesOpt = RECOVER.leaves,
    steer: SteerOpt = RECOVER.steer,
    whole_share: WholeShareOpt = RECOVER.whole_share,
    temperature: TemperatureOpt = RECOVER.temperature,
    pool: PoolOpt = RECOVER.pool,
    average: AverageOpt = RECOVER.average,
    holdout: HoldoutOpt = RECOVER.holdout,
    held_subset: HeldSubsetOpt = None,
    train: TrainOpt = RECOVER.train.value,
    pull: PullOpt = RECOVER.pull,
    optimizer: OptimizerOpt = RECOVER.optimizer.value,
    time: RecoverTimeOpt = None,
    subset: SubsetOpt = None,
    limit: LimitOpt = None,
    flip: FlipOpt = False,
    batch_size: TrainBatchOpt = RECOVER.batch_size,
    provider: TeacherProviderOpt = RECOVER.provider,
    seed: DrawSeedOpt = RECOVER.seed,
    memory: MemoryOpt = None,
    spill_dir: SpillDirOpt = None,
    input_shape: InputShapeOpt = None,
    report: ReportOpt = None,
    quiet: QuietOpt = False,
    **image_flags: Any,
) -> None:
    """Few-shot recovery: block-wise reconstruction, then distillation on augmented images, towards the teacher,
    within 15 minutes by default (--time).

    Never worse: the result is kept only if it is closer to the teacher (KL for classifiers) on the
    held-out calibration samples than the input; otherwise the input is written unchanged."""
    values = dict(locals(), **image_flags)
    try:
        if output.resolve() in (model.resolve(), teacher.resolve()):
            raise OutputError(f"output {output} is an input model: choose another -o path")
        check_outputs((output, "-o"), (report, "--report"), inputs=[model, teacher])
        job = jobs.recover_job(values)
        result = _recover(job.run, quiet)
        save(result, output, report, refuse=[model, teacher])
    except OnnxPruneError as exc:
        fail(exc)
    print_recovery(result.report)
    console.print(f"wrote {output}")


