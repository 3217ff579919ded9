"""Every flag's type and help, declared once (``typer`` annotations that the commands of ``onnxprune.cli`` take), and
the library's defaults they show; ``images`` adds the preprocessing flags to a command."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD
from onnxprune.recovery import RecoverOptions
from onnxprune.recovery.options import DISTILL_LRS
from onnxprune.recovery.train import LR_TRIAL
from onnxprune.strategies import ALLOCATORS, RECONSTRUCTORS, SELECTORS, CompressOptions

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
IMAGE_FLAGS: dict[str, tuple[Any, Any]] = {  # name: (type and help, default) of how images become a model's input
    "resize": (ResizeOpt, None), "crop": (CropOpt, None), "mean": (MeanOpt, DEFAULT_MEAN), "std": (StdOpt, DEFAULT_STD),
    "layout": (LayoutOpt, "auto"), "bgr": (BgrOpt, False)}
AFTER = ("subset", "limit", "flip")  # the image flags follow the last of these a command takes


def images(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` taking the image flags (``IMAGE_FLAGS``: --resize, --crop, --mean, --std, --layout, --bgr),
    declared here once: they join its signature after --subset (--limit, --flip: ``AFTER``) and reach it as keyword
    arguments (its ``**images``)."""
    own = [p for p in inspect.signature(command, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD]
    at = 1 + max((i for i, p in enumerate(own) if p.name in AFTER), default=len(own) - 1)
    added = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=kind, default=default)
             for name, (kind, default) in IMAGE_FLAGS.items()]

    @functools.wraps(command)
    def with_images(**values: Any) -> None:
        command(**values)

    params = own[:at] + added + own[at:]
    with_images.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    with_images.__annotations__ = {p.name: p.annotation for p in params}
    return with_images


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
AllocationOpt = Annotated[Optional[str], typer.Option(
    help="Per-layer widths: 'output' (the default except under compress --recover-steps; judged on the network's "
         "output: each layer alone pruned to 75/50/25% on 64 calibration samples, the output's discrepancy (see "
         "--task) measured on up to 32 others, fewer where probing would cost more than 4 forward passes of the "
         "calibration set; the "
         "budget goes where the output degrades least per MAC saved, each layer ≥ 25%), 'epsilon' (one "
         "threshold on every layer's relative imitation loss, the paper's rule, searched to meet the budget), "
         "'uniform' keep ratio, 'curve' (greedy on the local error curves, each layer ≥ 25%), or 'recover' (for a "
         "model `recover` will train: 'output' with the last third of the layers' discrepancy weighing 3 times, so "
         "the first layers are pruned more; recover mends their error on new photos, not the last ones'; the default "
         "with compress --recover-steps).")]
ImitationTargetOpt = Annotated[str, typer.Option(
    help="Imitation target: 'original' (the original network's layer output, corrects earlier layers' "
         "error) or 'paper' (the layer's own output on the pruned prefix).")]
ReconstructOpt = Annotated[str, typer.Option(
    help="Consumer weights after selection: the least-squares 'refit', per-channel 'scale', or 'none' "
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
MosaicOpt = Annotated[float, typer.Option(
    help="Distill stage: the share of images made a 2x2 mosaic of four at half size (0 = none).")]
LeavesOpt = Annotated[float, typer.Option(
    help="Distill stage: the share of images replaced by dead-leaves images (discs and boxes in the photos' "
         "colours; 0 = none).")]
SteerOpt = Annotated[float, typer.Option(
    help="Distill stage, whole model of a classifier: the share of images moved by two gradient steps on the "
         "teacher towards random classes (0 = none).")]
WholeShareOpt = Annotated[float, typer.Option(
    help="Distill stage, whole model: its share of --time, after the block stage's.")]
TemperatureOpt = Annotated[float, typer.Option(
    help="Distill stage, a classifier: soften the teacher's and the student's probabilities by T in the KL "
         "(1 = as they are); checkpoints are still chosen on the plain KL.")]
PoolOpt = Annotated[int, typer.Option(
    help="Distill stage, a classifier: draw N times the batch's inputs and train on those the student disagrees "
         "with most (their KL from the teacher; 1 = every input drawn).")]
AverageOpt = Annotated[float, typer.Option(
    help="Distill stage: keep a moving average of the trained weights, each step weighing 1 - A (0 = the last "
         "step's weights); checkpoints are chosen on the average.")]
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
OptimizerOpt = Annotated[str, typer.Option(
    help="Both stages' update rule: 'adam', or 'tensor-adam' (Adam with one second moment a tensor: a weight whose "
         "gradient is small moves little).")]
TrainBatchOpt = Annotated[int, typer.Option(help="Training batch size.")]
TeacherProviderOpt = Annotated[str, typer.Option(help="Execution provider for the teacher: auto, cpu, cuda.")]
DrawSeedOpt = Annotated[int, typer.Option(help="Seed of the mini-batch draws.")]
