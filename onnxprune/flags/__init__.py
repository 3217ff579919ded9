"""The command line's flags, declared once: each flag's type and help (``typer`` annotations that the commands of
``onnxprune.cli`` take), and the objects of the API that their values build (``preprocess``, ``budget``,
``compress_job``, ``recover_job``). A flag's values arrive as a dict keyed by the command's parameter names:
the CLI passes its own, the benchmarks read a flag list through the CLI's parser (``onnxprune.cli.flag_values``),
so both build the same objects from the same flags and defaults.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
import re
from pathlib import Path
from typing import Annotated, Any, Optional

import onnx
import typer

from onnxprune import api
from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess
from onnxprune.deploy.quantize import QuantizeOptions
from onnxprune.errors import OnnxPruneError, OptionError, TargetError
from onnxprune.recovery import RecoverOptions
from onnxprune.recovery.options import DISTILL_LRS
from onnxprune.recovery.train import LR_TRIAL
from onnxprune.runtime.store import memory_bytes
from onnxprune.strategies import (ALLOCATORS, RECONSTRUCTORS, SELECTORS, Budget, CompressOptions, Latency, MACs, Ratio,
                                  named)
from onnxprune.sweep import SweepResult, SweepRow, sweep as run_sweep

Values = Mapping[str, Any]  # a command's flag values by parameter name
# The library's defaults, which the flags take: the strategies' command-line names, and recover's options.
METHOD, ALLOCATION, RECONSTRUCT = (
    next(name for name, kind in names.items() if type(default) is kind)
    for names, default in ((SELECTORS, CompressOptions.select), (ALLOCATORS, CompressOptions.allocate),
                           (RECONSTRUCTORS, CompressOptions.reconstruct)))
RECOVER = RecoverOptions()
MACS_HELP = ("MACs count the multiply-accumulates of Conv, ConvTranspose, Gemm and MatMul per sample, the "
             "convention of pruning papers (their 'FLOPs').")


# ---------------------------------------------------------------- images and calibration (every command)

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
CompressFlipOpt = Annotated[Optional[bool], typer.Option(
    "--flip/--no-flip", help="Add each calibration image's mirror (default: for a classifier, a model whose first "
                             "output is 2-D: its refits fit on twice the samples, in about 1.6x the time).")]
DEFAULT_MEAN = ",".join(map(str, IMAGENET_MEAN))
DEFAULT_STD = ",".join(map(str, IMAGENET_STD))
BgrOpt = Annotated[bool, typer.Option("--bgr", help="Feed channels in BGR order.")]
SubsetOpt = Annotated[Optional[str], typer.Option(
    help="Subset of the sorted image list: 'a:b[:s]' slice, 'k%n' (index mod n == k), either with '!' for the rest, "
         "joined by '&' to intersect ('!0:125&!1%5').")]
InputShapeOpt = Annotated[Optional[list[str]], typer.Option(
    "--input-shape", help="Shape for dynamic inputs: 1x3x224x224, or name:1x3x320x320 per input (repeatable).")]


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
CompressBatchOpt = Annotated[int, typer.Option(
    help="Samples per statistics batch, and at most per onnxruntime run (on the CPU fewer, down to 2, where a run's "
         "activations would pass 32 MB).")]
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
EmptySamplesOpt = Annotated[bool, typer.Option(
    "--empty-samples/--no-empty-samples",
    help="A detector fits and probes on every calibration sample, also those where the original finds no object "
         "(default: only those with one, others evenly added up to 32; images without objects cost it fidelity).")]
RemoveBlocksOpt = Annotated[bool, typer.Option(
    "--remove-blocks/--no-remove-blocks",
    help="Let the output allocation also remove whole residual blocks (a block whose inner channels feed one "
         "Conv into the residual Add, e.g. MobileNetV2's inverted residuals with a shortcut, ResNet's basic "
         "blocks): probed like a width, the block becomes its shortcut plus a fitted constant, and the later "
         "layers' refits absorb it.")]
MemoryOpt = Annotated[Optional[str], typer.Option(
    help="RAM for the cached activations of the calibration set (e.g. 4G, 512M); past it they are spilled to "
         "--spill-dir and read back by ranges; compress's statistics unfold at most a quarter of it at a time. "
         "Default: half of the memory available at the start, less where compress's other needs would not fit "
         "(it says so). The written model does not depend on it.")]
SpillDirOpt = Annotated[Optional[Path], typer.Option(
    help="Folder for spilled activations (default: the system's temporary folder); the files are unlinked as "
         "soon as they are open, so nothing is left behind.")]
TaskOpt = Annotated[str, typer.Option(
    help="How the outputs are read: 'auto' (from their layout), 'classify', 'detect' (YOLOv5/v8/v11, YOLOX, "
         "PicoDet/PP-YOLOE score and box outputs; sets of detections: [N, K, 6] rows, DETR queries, "
         "boxes/scores/classes), 'segment' (a YOLO mask head), 'heatmap' (CenterNet peaks), 'mask' (a binary or "
         "salient mask), 'ctc' (a text recogniser), 'seq' (an attention decoder's [N, L, classes] token scores, L "
         "varying; the last class ends a sequence), 'textdet' (a text detector's probability map) or 'raw' (the "
         "tensors as they are).")]
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="No progress on stderr (by default: a bar on a terminal, else a plain line at least "
                          "every 10 s: the phase, the step, the time spent and an estimate of what is left).")]
ReportOpt = Annotated[Optional[Path], typer.Option(help="Write a JSON report here.")]
ManifestOpt = Annotated[Optional[Path], typer.Option(
    help="Write the kept-channel manifest here (JSON; its weights in the .npz beside it): per changed node, its torch "
         "module path, the original channels kept, its new weights; onnxprune.torch.apply_manifest slices your "
         "own module to match.")]
CalibOpt = Annotated[str, typer.Option(help="Calibration data: image folder, .npy/.npz, or file.py:fn.")]


RecoverTimeOpt = Annotated[Optional[str], typer.Option(
    "--time", help="Bound the whole recovery (e.g. 15m, 900s, 1h; default 15m unless --steps or --distill-steps "
                   "is given): each training loop runs for its share of the time, the best held-out checkpoint "
                   "kept, with the time left in the progress line; the training samples are thinned where "
                   "the passes over them would take more than 30% of it (and 30 s). Fidelity against minutes: "
                   "benchmarks/results/notebook/recovery-2.md, 'Fidelity against minutes of recovery'.")]


# ---------------------------------------------------------------- sweep

TargetsOpt = Annotated[Optional[str], typer.Option(
    help="Comma-separated budgets, each as compress takes it: MAC ratios (0.9,0.8,0.7,0.6), MACs (245M) or "
         "latencies (3.5ms, 0.8x).")]
HeldOpt = Annotated[Optional[Path], typer.Option(
    help="Image folder the models are judged on (default: every fifth image of --calib, which then calibrates on "
         "the others).")]
KeepOpt = Annotated[Optional[float], typer.Option(
    help="Also find the cheapest MAC ratio whose held-out task metric against the original (a detector's "
         "mAP50-95, a classifier's top-1 agreement, a mask's IoU, ...) is at least this: the --targets, else the "
         "ratios 0.9 down to 0.5, then two halvings of the last gap.")]
BenchOpt = Annotated[bool, typer.Option(help="Time every model against the original (onnxruntime, CPU, batch 1).")]


# ---------------------------------------------------------------- recover

RecoverMethodOpt = Annotated[str, typer.Option(
    help="'block' reconstruction (each changed segment trained to reproduce the teacher's tensor at its end), "
         "'distill'ation of the outputs on augmented images (both models see the same crop/flip/mix), or "
         "'block+distill' (default: both, in this order).")]
StepsOpt = Annotated[Optional[int], typer.Option(
    help="Block stage: Adam steps per segment whose weights differ from the teacher's (200 where left out). Given "
         "without --time, step counts bound the run instead of the time.")]
LrOpt = Annotated[float, typer.Option(help="Block stage: Adam learning rate (cosine decay).")]
BlockWindowOpt = Annotated[int, typer.Option(
    help="Block stage: train N consecutive changed segments together, to the original's tensor at the last one's "
         "end (a segment then corrects what the next cannot represent); 1 = each on its own.")]
DistillStepsOpt = Annotated[Optional[int], typer.Option(
    help="Distill stage: Adam steps (600 where left out). Given without --time, step counts bound the run instead of "
         "the time.")]
DistillLrOpt = Annotated[Optional[float], typer.Option(
    help="Distill stage: Adam learning rate (cosine decay). Left out: each of "
         f"{', '.join(f'{lr:.0e}' for lr in DISTILL_LRS)} trains for {LR_TRIAL:.0%} of the stage from the same "
         "weights, and the one with the lowest held-out loss trains the rest, from where its trial ended.")]
DistillSegmentsOpt = Annotated[Optional[int], typer.Option(
    help="Distill stage: train only the last N segments (the head; back to the last one with weights when those "
         "have none, e.g. a Softmax at the end), on their inputs cached for --distill-views augmented views of "
         "every training sample; 0 = the whole model, augmented on the fly. Default: the whole model for a "
         "classifier where 100 of its steps fit in half of --time, else 2 (the report says which).")]
DistillViewsOpt = Annotated[int, typer.Option(
    help="Distill stage: augmented views per training sample cached for the head (fewer under --time where caching "
         "them would take more than a quarter of the stage).")]
DistillFeaturesOpt = Annotated[float, typer.Option(
    help="Distill stage, whole model: weight of the block outputs (the tensors the segments end at) matched to the "
         "teacher's, beside the outputs' objective; 0 = the outputs only.")]
MixOpt = Annotated[str, typer.Option(
    help="Distill stage: 'mixup', 'cutmix', 'both' (one of them drawn for each batch) or 'none', after random resized "
         "crop, flip and --colour.")]
ColourOpt = Annotated[float, typer.Option(
    help="Distill stage: random contrast, saturation and brightness factors in [1 - C, 1 + C] (0 = none).")]
WholeShareOpt = Annotated[float, typer.Option(
    help="Distill stage, whole model: its share of --time, after the block stage's.")]
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


# ---------------------------------------------------------------- values -> objects


def parse_macs(text: str) -> float:
    """A MAC count as written on the command line: '245M' → 245e6, '2.2G' → 2.2e9, '300000' → 3e5."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)\s*", text)
    if not match:
        raise TargetError(f"cannot read {text!r} as a MAC count: write e.g. 245M, 2.2G or 300000000")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2).lower()]
    return float(match.group(1)) * scale


def parse_latency(text: str) -> tuple[float | None, float | None]:
    """'3.5ms' → (3.5, None), '800us' → (0.8, None), '0.8x' → (None, 0.8): milliseconds or a ratio of the
    original's measured latency."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|us|µs|s|x)\s*", text.lower())
    if not match:
        raise TargetError(f"cannot read {text!r} as a latency: write e.g. 3.5ms, 800us, or 0.8x (a fraction of "
                          "the original model's measured latency)")
    value, unit = float(match.group(1)), match.group(2)
    if unit == "x":
        if not 0 < value < 1:
            raise TargetError(f"latency {text}: a ratio must lie strictly between 0 and 1 (e.g. 0.8x)",
                              option="target_latency")
        return None, value
    if value <= 0:
        raise TargetError(f"latency {text} must be positive", option="target_latency")
    return value * {"ms": 1.0, "us": 1e-3, "µs": 1e-3, "s": 1e3}[unit], None


def parse_target(text: str) -> tuple[str, Budget]:
    """A sweep's budget, labelled, as compress's target flags take it: a MAC ratio ('0.8', --target-ratio), MACs
    ('245M', --target-flops) or a latency ('3.5ms', '0.8x', --target-latency)."""
    label = text.strip()
    if re.fullmatch(r"[0-9]*\.[0-9]+", label) and 0 < float(label) < 1:
        return label, Ratio(float(label))
    try:
        if re.search(r"(ms|us|µs|s|x)$", label.lower()):
            return label, Latency(*parse_latency(label))
        return label, MACs(parse_macs(label))
    except TargetError as exc:
        raise TargetError(f"target {text!r} is not a MAC ratio (0.8), MACs (245M) or a latency (3.5ms, 0.8x): {exc}",
                          option="targets") from None


def parse_duration(text: str | None) -> float | None:
    """Seconds of '900', '900s', '15m' or '1.5h' (None stays None)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9.]+)\s*([smh]?)\s*", text)
    if m is None:
        raise OnnxPruneError(f"time {text!r} is not a duration: 900, 900s, 15m or 1.5h", option="time")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def numbers(text: str) -> tuple[float, ...]:
    """``"0.485,0.456,0.406"`` → a tuple of floats (--mean, --std)."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise OnnxPruneError(f"cannot read {text!r} as comma-separated numbers (e.g. 0.485,0.456,0.406)") from None


def preprocess(model: api.ModelSource, values: Values) -> Preprocess:
    """The image preprocessing of the flags for ``model``; --input-shape sizes the crop of a model given as a path
    (a loaded model has its shapes already)."""
    shapes = None if isinstance(model, onnx.ModelProto) else values.get("input_shape")
    return api.preprocess_for(model, input_shape=shapes, resize=values["resize"], crop=values["crop"],
                              mean=numbers(values["mean"]), std=numbers(values["std"]), layout=values["layout"],
                              bgr=values["bgr"])


def calibration(values: Values, model: onnx.ModelProto, prep: Preprocess, held_subset: str | None
                ) -> tuple[api.CalibrationSet, api.CalibrationSet | None]:
    """The calibration samples of the flags (--calib, --subset, --limit, --flip), and the held-out ones of
    ``held_subset`` (None without it)."""
    data = api.calibration(values["calib"], model, prep, subset=values["subset"], limit=values["limit"],
                           flip=values["flip"])
    return data, None if held_subset is None else api.calibration(values["calib"], model, prep, subset=held_subset)


def budget(values: Values) -> MACs | Ratio | Latency:
    """The budget of compress's target flags (exactly one of them)."""
    flops, ratio, latency = values["target_flops"], values["target_ratio"], values["target_latency"]
    cost_table, save_cost_table = values["cost_table"], values["save_cost_table"]
    if [flops, ratio, latency].count(None) != 2:
        raise TargetError("give exactly one of --target-flops (e.g. 245M), --target-ratio (e.g. 0.8) or "
                          "--target-latency (e.g. 3.5ms or 0.8x)")
    if (cost_table or save_cost_table) and not latency:
        raise TargetError("--cost-table and --save-cost-table go with --target-latency")
    if flops:
        return MACs(parse_macs(flops))
    if ratio is not None:
        return Ratio(ratio)
    latency_ms, latency_ratio = parse_latency(latency)
    return Latency(latency_ms, latency_ratio, values["latency_batch"], values["threads"],
                   cost_table and str(cost_table), save_cost_table and str(save_cost_table))


@dataclass
class CompressJob:
    """What compress's flags ask for, checked and loaded: ``run`` prunes; ``recovery`` is the recovery that
    --recover-steps asks for after it (None: none), on the ``held`` samples of --recover-held-subset."""

    model: onnx.ModelProto
    data: api.CalibrationSet
    held: api.CalibrationSet | None
    options: dict[str, Any]  # api.compress's keywords
    recovery: RecoverOptions | None
    int8: QuantizeOptions | None = None  # --int8: the quantization of the written model

    def run(self, on_layer: Callable[[int, int, str], None] | None = None) -> api.Result:
        return api.compress(self.model, self.data, **self.options, on_layer=on_layer)


def compress_job(values: Values) -> CompressJob:
    """The budget and the strategies first (a wrong flag fails before any loading), then the model, its
    preprocessing and the calibration samples."""
    v = values
    chosen = budget(v)
    if v["recover_held_subset"] is not None and v["recover_steps"] < 1:
        raise OnnxPruneError("--recover-held-subset goes with --recover-steps N (N ≥ 1)")
    select, allocate, reconstruct = named(v["method"], v["allocation"], v["reconstruct"], v["target"], v["seed"],
                                          v["remove_blocks"], v["global_budget"])
    model = api.load(v["model"], v["input_shape"])
    prep = preprocess(model, v)
    data, held = calibration(v, model, prep, v["recover_held_subset"])
    options = dict(budget=chosen, select=select, allocate=allocate, reconstruct=reconstruct, preprocess=prep,
                   round_to=v["round_to"], batch_size=v["batch_size"], provider=v["provider"],
                   best_effort=v["best_effort"], residual_streams=v["residual_streams"], memory=v["memory"],
                   spill_dir=v["spill_dir"], task=v["task"], empty_samples=v["empty_samples"])
    recovery = None if v["recover_steps"] < 1 else RecoverOptions(
        steps=v["recover_steps"], batch_size=v["batch_size"], provider=v["provider"], seed=v["seed"], **_store(v))
    return CompressJob(model, data, held, options, recovery, int8(v))


def int8(values: Values) -> QuantizeOptions | None:
    """The quantization that --int8 asks for (in --runtime's layout, judged by --task, widening its float prefix to
    --max-loss), None without it; --max-loss without --int8 is an OptionError."""
    if values["max_loss"] is not None and not values["int8"]:
        raise OptionError("--max-loss bounds the INT8 model's loss: give it with --int8", option="max_loss")
    return (QuantizeOptions(runtime=values["runtime"], task=values["task"], max_loss=values["max_loss"])
            if values["int8"] else None)


def _store(values: Values) -> dict[str, Any]:
    """RecoverOptions' ``memory`` (bytes) and ``spill_dir`` (text) from --memory and --spill-dir."""
    return {"memory": memory_bytes(values["memory"]), "spill_dir": values["spill_dir"] and str(values["spill_dir"])}


@dataclass
class RecoverJob:
    """What recover's flags ask for, checked and loaded: ``run`` trains."""

    student: onnx.ModelProto
    teacher: onnx.ModelProto
    data: api.CalibrationSet
    held: api.CalibrationSet | None  # the --held-subset samples
    options: RecoverOptions

    def run(self, on_progress: Callable[[str, int, int, float | None], None] | None = None) -> api.Result:
        return api.recover(self.student, self.teacher, self.data, options=self.options, held=self.held,
                           on_progress=on_progress)


def recover_job(values: Values) -> RecoverJob:
    """The student and the teacher, the preprocessing (the teacher's), the options and the calibration samples."""
    v = values
    student, teacher = api.load(v["model"], v["input_shape"]), api.load(v["teacher"], v["input_shape"])
    prep = preprocess(teacher, v)
    options = RecoverOptions(method=v["method"], steps=v["steps"], lr=v["lr"], block_window=v["block_window"],
                             distill_steps=v["distill_steps"], distill_lr=v["distill_lr"],
                             distill_segments=v["distill_segments"], distill_views=v["distill_views"],
                             distill_features=v["distill_features"], mix=v["mix"],
                             colour=v["colour"], whole_share=v["whole_share"],
                             layout=prep.layout,
                             batch_size=v["batch_size"], holdout=v["holdout"], train=v["train"], pull=v["pull"],
                             seed=v["seed"], provider=v["provider"], time=parse_duration(v["time"]), **_store(v))
    data, held = calibration(v, teacher, prep, v["held_subset"])
    return RecoverJob(student, teacher, data, held, options)


def sweep(values: Values, on_layer: Callable[[int, int, str], None] | None = None) -> SweepResult:
    """sweep's flags: the budgets of --targets (and --keep's search) on one calibration, judged on --held."""
    v = values
    select, allocate, reconstruct = named(v["method"], v["allocation"], v["reconstruct"])
    model = api.load(v["model"], v["input_shape"])
    targets = dict(parse_target(t) for t in (v["targets"] or "").split(",") if t.strip())
    if not targets and v["keep"] is None:
        raise OnnxPruneError("give --targets (e.g. 0.9,0.8,0.7,0.6 or 245M,170M), --keep (e.g. 0.95), or both")
    return run_sweep(model, v["calib"], targets, v["output"], held=v["held"], keep=v["keep"], subset=v["subset"],
                     flip=v["flip"], preprocess=preprocess(model, v), select=select, allocate=allocate,
                     reconstruct=reconstruct, round_to=v["round_to"], batch_size=v["batch_size"],
                     provider=v["provider"], memory=v["memory"], task=v["task"], bench=v["bench"], int8=int8(v),
                     on_layer=on_layer)


def keep(values: Values, on_layer: Callable[[int, int, str], None] | None = None
         ) -> tuple[SweepResult, SweepRow, Path]:
    """compress --keep: the sweep's search (no targets, every fifth --calib image held out, no timing) into
    <output>.sweep/; the result, the chosen row and that folder."""
    if any(values[k] is not None for k in ("target_flops", "target_ratio", "target_latency")):
        raise TargetError("--keep chooses the budget itself: leave out --target-flops/--target-ratio/--target-latency")
    if values["recover_steps"]:
        raise OnnxPruneError("--keep and --recover-steps do not go together: recover the chosen model afterwards")
    folder = values["output"].with_name(values["output"].stem + ".sweep")
    result = sweep({**values, "targets": None, "output": folder, "held": None, "bench": False}, on_layer)
    return result, next(r for r in result.rows if r.target == result.keep["chosen"]), folder
