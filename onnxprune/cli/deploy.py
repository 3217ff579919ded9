"""The commands after pruning: ``eval``, ``bench``, ``export``, ``quantize``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.markup import escape

from onnxprune import api
from onnxprune.flags import deploy as flags
from onnxprune.cli.app import app, check_outputs, fail, save
from onnxprune.deploy.quantize import QuantizeOptions
from onnxprune.deploy.export import TensorRTUnavailable
from onnxprune.errors import ModelError, OnnxPruneError, OutputError
from onnxprune.flags.deploy import (
    FloatEndsOpt, MaxLossOpt, MethodsOpt, QuantHeldOpt, QuantRefOpt, ReduceRangeOpt, RoundingOpt, RuntimeOpt,
    SamplesOpt,
)
from onnxprune.flags.declared import (
    CalibOpt, InputShapeOpt, QuietOpt, ReportOpt, SubsetOpt, TaskOpt, images,
)
from onnxprune.tables import console, err_console, format_bench_table, format_table, print_quantize, progress
from onnxprune.tasks import CONF, NMS_IOU


@app.command("eval")
@images
def eval_cmd(
    model: Annotated[Path, typer.Argument(help="ONNX model to evaluate.")],
    images: Annotated[Path, typer.Option(help="Image folder; a leading number in a file name is its class.")],
    ref: Annotated[Optional[Path], typer.Option(help="Reference model for agreement / KL / output error.")] = None,
    subset: SubsetOpt = None,
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
    simulate_qdq: Annotated[bool, typer.Option(
        "--simulate-qdq", help="Run a quantized model's Q/DQ pairs in float, as TensorRT computes, instead of "
                               "onnxruntime's int8 kernels (whose 8-bit products saturate on x86 CPUs without "
                               "VNNI): how `quantize --runtime tensorrt` judges.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    **image_flags: Any,
) -> None:
    """Top-1/top-5 from file-name labels, agreement/KL/output error against --ref, and the task's metrics:
    mAP50 and mAP50-95 of a detector against --ref's detections (and --labels), mask IoU of a segmenter,
    string agreement of a CTC recogniser, region F1 of a text detector. Top-1, top-5, agreement, KL and a
    detector's mAP come with their spread over the images (± one standard deviation over resamples of them)."""
    values = dict(locals(), **image_flags)
    try:
        if not model.is_file():
            raise ModelError(f"{model}: no such file")
        result = flags.evaluate(values)
    except OnnxPruneError as exc:
        fail(exc)
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
        fail(exc)
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        console.print(format_bench_table(results))


@app.command("quantize")
@images
def quantize_cmd(
    model: Annotated[Path, typer.Argument(help="Float ONNX model (pruned or not).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the INT8 (QDQ) model.")],
    calib: CalibOpt,
    held: QuantHeldOpt = None,
    ref: QuantRefOpt = None,
    runtime: RuntimeOpt = QuantizeOptions.runtime,
    methods: MethodsOpt = ",".join(QuantizeOptions.methods),
    float_ends: FloatEndsOpt = QuantizeOptions.float_ends,
    rounding: RoundingOpt = QuantizeOptions.rounding,
    max_loss: MaxLossOpt = None,
    samples: SamplesOpt = QuantizeOptions.samples,
    reduce_range: ReduceRangeOpt = None,
    subset: SubsetOpt = None,
    input_shape: InputShapeOpt = None,
    task: TaskOpt = "auto",
    report: ReportOpt = None,
    quiet: QuietOpt = False,
    **image_flags: Any,
) -> None:
    """Static INT8 quantization (QDQ, onnxruntime's tools) with the calibration images, judged against --ref.

    Each calibration method is tried, then the best one with the first and last weighted layers kept in float, then
    the best so far with its weights rounded by GPTQ (--rounding); the model whose task metric against --ref (a
    classifier's top-1 agreement, a detector's mAP50-95, ...) is best on the held-out images is written, with the
    float input's and the INT8 model's scores beside it. With --max-loss, where that model loses more than it to
    the float input, the first and the last layers stay in float, as few as bring it within."""
    values = dict(locals(), **image_flags)
    try:
        if output.resolve() in (model.resolve(), *([ref.resolve()] if ref else [])):
            raise OutputError(f"output {output} is an input model: choose another -o path")
        check_outputs((output, "-o"), (report, "--report"), inputs=[model, *([ref] if ref else [])])
        if not model.is_file():
            raise ModelError(f"{model}: no such file")
        with progress("quantize", quiet) as advance:
            result = flags.quantize(values, advance)
        save(result, output, report, refuse=[model, *([ref] if ref else [])])
    except OnnxPruneError as exc:
        fail(exc)
    print_quantize(result.report, output)


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
        check_outputs((output if tensorrt else None, "-o"), (output.with_suffix(".trt.onnx"), "TensorRT-ready ONNX"),
                       inputs=[model])
        if tensorrt and not api.have_tensorrt():
            raise TensorRTUnavailable("TensorRT is not installed (pip install onnxprune[tensorrt]): add --no-tensorrt "
                                      "to write only the TensorRT-ready ONNX and the trtexec command that builds "
                                      "the engine on a machine with TensorRT")
        exported = api.export(model, output, tensorrt=tensorrt, fp16=fp16, workspace=workspace, input_shape=input_shape)
    except OnnxPruneError as exc:
        fail(exc)
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




