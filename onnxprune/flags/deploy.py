"""The flags of the commands after pruning (``eval``, ``bench``, ``quantize``) and the API calls their values make."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from onnxprune import api
from onnxprune.deploy.quantize import METHODS, QuantizeOptions
from onnxprune.flags.declared import Values
from onnxprune.flags.jobs import preprocess

RuntimeOpt = Annotated[str, typer.Option(
    help="The INT8 layout: 'onnxruntime' (its CPU kernels: unsigned asymmetric activations, signed symmetric "
         "per-channel weights, in 7 bits on an x86 CPU without VNNI, where 8-bit products saturate; judged with "
         "onnxruntime's int8 kernels) or 'tensorrt' (explicit quantization: signed symmetric activations and "
         "per-channel weights, float biases; judged with its Q/DQ pairs run in float, as an engine computes).")]
MethodsOpt = Annotated[str, typer.Option(
    help=f"Calibration methods tried, comma-separated ({', '.join(METHODS)}; percentile keeps 99.999%): the one "
         "whose model scores best on the held-out samples is kept.")]
FloatEndsOpt = Annotated[str, typer.Option(
    help="Keep the first weighted layer and the last ones (no weighted layer after them) in float: 'auto' (where "
         "that scores better on the held-out samples), 'yes' or 'no'.")]
SamplesOpt = Annotated[int, typer.Option(help="Calibration samples at most (evenly drawn from --calib).")]
RoundingOpt = Annotated[str, typer.Option(
    help="The weights' integers: 'nearest' to each weight, 'gptq' (rounded column by column, each error moved onto "
         "the columns not rounded yet, so that the layer's output on the calibration samples moves least), or "
         "'auto' (the best candidate both ways, the better on the held-out samples kept).")]
MaxLossOpt = Annotated[Optional[float], typer.Option(
    help="Where the best INT8 candidate's task metric lies more than this below the float input's on the held-out "
         "samples (e.g. 0.03), keep the first and the last weighted layers in float (2, 4, 8, ... at each end, at "
         "most a quarter, with every node before / after them), the fewest that bring it within; those layers run "
         "at float speed.")]
ReduceRangeOpt = Annotated[Optional[bool], typer.Option(
    "--reduce-range/--no-reduce-range",
    help="7-bit weights (default: for --runtime onnxruntime on an x86 CPU without VNNI).")]
Int8Opt = Annotated[bool, typer.Option(
    "--int8", help="Also write the pruned model quantized to INT8 beside it (<output>.int8.onnx), as `quantize` "
                   "does: every fifth calibration image held out chooses the calibration method and the layers kept "
                   "in float, and judges it against the original (these images are ones the pruner fitted).")]
QuantHeldOpt = Annotated[Optional[Path], typer.Option(
    help="Image folder that chooses among the candidates and judges the result (default: every fifth image of "
         "--calib, which then calibrates on the others).")]
QuantRefOpt = Annotated[Optional[Path], typer.Option(
    help="The original model the input was pruned from: the metrics are measured against it (default: the input).")]


def quantize_options(values: Values) -> QuantizeOptions:
    """QuantizeOptions of quantize's flags (also those of compress --int8)."""
    return QuantizeOptions(runtime=values["runtime"], methods=tuple(m.strip() for m in values["methods"].split(",")
                                                                     if m.strip()),
                           float_ends=values["float_ends"], rounding=values["rounding"], samples=values["samples"],
                           reduce_range=values["reduce_range"], task=values["task"], max_loss=values["max_loss"])


def quantize(values: Values, on_step: Callable[[int, int, str], None] | None = None) -> api.Result:
    """quantize's flags: the model calibrated on --calib, chosen and judged on --held against --ref."""
    v = values
    options = quantize_options(v)
    model = api.load(v["model"], v["input_shape"])
    return api.quantize(model, v["calib"], held=v["held"], reference=v["ref"], options=options,
                        preprocess=preprocess(model, v), input_shape=v["input_shape"], subset=v["subset"],
                        on_step=on_step)


def evaluate(values: Values) -> api.EvalResult:
    """eval's flags: the model (against --ref) on --images."""
    model = values["model"]
    return api.evaluate(model, values["images"], values["ref"], preprocess=preprocess(model, values),
                        subset=values["subset"], provider=values["provider"], task=values["task"],
                        conf=values["conf"], iou=values["iou"], truth=values["labels"],
                        simulate_qdq=values["simulate_qdq"])


def bench(values: Values, on_round: Callable[[int, int], None] | None = None) -> list[api.BenchResult]:
    """bench's flags: the models timed in turns."""
    v = values
    return api.bench(v["models"], provider=v["provider"], batch=v["batch"], threads=v["threads"], spin=v["spin"],
                     warmup=v["warmup"], runs=v["runs"], input_shape=v["input_shape"], on_round=on_round)
