"""``recover``: few-shot recovery of a pruned model from its teacher on unlabeled calibration data.

Two stages, run in this order by the default method ``block+distill``:

- ``block``: block-wise reconstruction. The student is cut at the tensors it shares with the
  teacher (see ``segments``); going from the input, each segment whose weights were changed by
  pruning is trained to reproduce the teacher's tensor at its end from the student's own tensor at
  its start, so it also corrects the error of the segments before it.
- ``distill``: distillation towards the teacher's outputs (KL for classifiers, relative MSE
  otherwise) on consistently augmented inputs: both networks see the same randomly cropped,
  flipped and mixed images (see ``augment``). By default only the last ``distill_segments``
  segments (the head) are trained, on their inputs cached for ``distill_views`` augmented views of
  every training sample, rather than the whole model (``distill_segments=0``), whose earlier layers the
  block stage already matched.

A held-out part of the calibration set is split in two: one half picks the best checkpoint of every
stage, the other judges the result (a verdict on the samples that picked the checkpoints would favour
them): the recovered model is returned only if it agrees better with the teacher on that half than
the input did, and only if onnxruntime on the written model reproduces the trained torch weights.
Samples the pruner fitted on make an optimistic held-out set: pass ``held`` samples it did not see.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.ir.load import import_graph
from onnxprune.ir.shapes import infer_shapes
from onnxprune.calib.sources import CalibrationSet
from onnxprune.errors import CalibrationError, OnnxPruneError, OptionError, check_choice
from onnxprune.recovery.augment import Mix, augment_images
from onnxprune.recovery.segments import Segment, find_segments, head_start
from onnxprune.recovery.train import distill, evaluate_net, fit, kl_loss, relative_mse
from onnxprune.ir.probe import fixed_batch
from onnxprune.runtime.segments import run_segment
from onnxprune.runtime.store import Array, Store, check_memory, default_budget
from onnxprune.runtime.torch_eval import TorchGraph, write_back

class Train(StrEnum):
    """What a stage trains: every float weight of a changed segment, or only the weights pruning changed."""

    SEGMENT = "segment"
    CHANGED = "changed"


class Layout(StrEnum):
    """The layout of an image input, for the augmentation."""

    NCHW = "nchw"
    NHWC = "nhwc"


TRAIN = tuple(t.value for t in Train)


class Method(StrEnum):
    """The recovery stages to run: block-wise reconstruction, distillation, or both in this order."""

    BLOCK_DISTILL = "block+distill"
    BLOCK = "block"
    DISTILL = "distill"

    @property
    def block(self) -> bool:
        """Whether the block-wise reconstruction stage runs."""
        return self in (Method.BLOCK_DISTILL, Method.BLOCK)

    @property
    def distill(self) -> bool:
        """Whether the distillation stage runs."""
        return self in (Method.BLOCK_DISTILL, Method.DISTILL)


METHODS = tuple(m.value for m in Method)
Progress = Callable[[str, int, int, float | None], None]
Augment = Callable[[list[torch.Tensor], torch.Generator], list[torch.Tensor]]


def writeback_tolerance(device: torch.device) -> float:
    """Largest relative difference allowed between onnxruntime on the written model and the trained
    torch weights: float32 kernels summing in other orders (~1e-6 on CPU), or cuDNN convolutions in
    TF32 (~1e-3) on CUDA. A weight left unwritten differs by what the training changed."""
    return 1e-4 if device.type == "cpu" else 1e-2


@dataclass
class RecoverOptions:
    """The recovery's settings, checked when built (a bad value raises OptionError naming the field).

    ``method``, ``train``, ``mix`` and ``layout`` are enums (``Method``, ``Train``, ``Mix``, ``Layout``) or their
    values ('block+distill', 'segment', 'mixup', 'nchw', ...); they are stored as the enums."""

    method: Method | str = Method.BLOCK_DISTILL
    steps: int = 200  # Adam steps per trainable segment (block stage)
    lr: float = 1e-3
    distill_steps: int = 600  # Adam steps of the distillation stage
    distill_lr: float = 1e-4
    distill_segments: int = 2  # trailing segments the distillation trains; 0 = the whole model
    distill_views: int = 8  # augmented views of every training sample cached for a head distillation
    mix: Mix | str = Mix.MIXUP  # mixing of the distillation images (after random resized crop and flip)
    layout: Layout | str = Layout.NCHW  # of an image input, for the augmentation
    batch_size: int = 32
    holdout: float = 0.2  # fraction of the calibration samples kept aside to choose checkpoints
    train: Train | str = Train.SEGMENT  # every float weight (of a changed segment), or only the changed ones
    pull: float = 0.0  # decay towards the starting weights
    seed: int = 0
    provider: str = "auto"  # onnxruntime provider computing the teacher's tensors
    device: str = "auto"  # torch device of the training: 'auto' = CUDA when torch sees one, else CPU
    memory: int | None = None  # bytes of cached tensors held in RAM, the rest spilled (None: half the available)
    spill_dir: str | None = None  # where spilled tensors go (None: the system's temporary folder)

    def torch_device(self) -> torch.device:
        return torch.device("cuda" if self.device == "auto" and torch.cuda.is_available() else
                            "cpu" if self.device == "auto" else self.device)

    def __post_init__(self) -> None:
        for name, kind in (("method", Method), ("train", Train), ("mix", Mix), ("layout", Layout)):
            check_choice(name, getattr(self, name), tuple(k.value for k in kind))
            setattr(self, name, kind(getattr(self, name)))
        for name, least in (("steps", 1), ("distill_steps", 1), ("distill_views", 1), ("distill_segments", 0)):
            if getattr(self, name) < least:
                raise OptionError(f"{name} {getattr(self, name)} must be at least {least}", option=name)
        check_memory(self.memory)

    def store(self) -> Store:
        """Where the run's cached tensors live (``runtime.store``)."""
        return Store(default_budget() if self.memory is None else self.memory, self.spill_dir)


@dataclass
class SegmentReport:
    end: list[str]
    parameters: int
    held_before: float
    held_after: float
    best_step: int
    seconds: float


@dataclass
class DistillReport:
    parameters: int
    whole_model: bool  # every weight trained on batches augmented on the fly (else the head on cached views)
    trained_from: list[str]  # the tensors the trained part starts at
    samples: int  # training samples seen: cached views of a head, or on-the-fly augmented batches
    augment: str  # what the inputs went through
    held_before: float  # held-out metric (the report's) when the stage started
    held_after: float
    best_step: int
    seconds: float


@dataclass
class RecoverReport:
    samples_train: int
    samples_held: int  # the held-out samples: those that picked the checkpoints, then those that judged
    samples_verdict: int  # the held-out samples that judged the result (before / after), none of which picked
    held_unseen: bool  # the held-out samples were given apart (True) or split off the calibration set
    metric: str  # "kl" (KL(teacher || student) of 2-D outputs' rows as probabilities) or "rel_mse"
    before: float  # metric of the input model on the verdict samples
    after: float  # ... of the recovered weights (returned only if lower)
    agreement_before: float | None  # top-1 agreement with the teacher on the verdict samples (classifiers)
    agreement_after: float | None
    improved: bool  # False: the input model was returned unchanged
    writeback_error: float = 0.0  # relative difference, onnxruntime on the written model vs the trained torch
    # (on the checkpoint-picking samples); past ``writeback_tolerance`` recover raises instead
    seconds: float = 0.0
    device: str = "cpu"  # where torch trained
    options: dict = field(default_factory=dict)
    segments: list[SegmentReport] = field(default_factory=list)
    distill: DistillReport | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _arrays(calib: CalibrationSet, batch_size: int, store: Store) -> dict[str, Array]:
    if len(calib) == 0:
        raise CalibrationError("the calibration set is empty: give a folder or file with samples")
    return store.stack(calib.batches(batch_size), len(calib))


def split(n: int, holdout: float, pair: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Every ⌈1/holdout⌉-th block of ``pair`` samples (an image and its mirror) is held out."""
    if not 0 < holdout < 1:
        raise CalibrationError(f"holdout must be between 0 and 1, got {holdout}")
    every = max(2, round(1 / holdout))
    block = np.arange(n) // pair
    held = block % every == every - 1
    if held.sum() < 2 * pair or (~held).sum() < 2:
        raise CalibrationError(f"{n} calibration samples are too few to hold out {holdout:.0%}: give at least "
                               f"{2 * every * pair} samples")
    return np.flatnonzero(~held), np.flatnonzero(held)


def halves(held: np.ndarray, pair: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The held-out samples that pick checkpoints and those that judge the result: alternate blocks of
    ``pair`` (an image and its mirror stay together)."""
    judge = np.arange(len(held)) // pair % 2 == 1
    return held[~judge], held[judge]


def _samples(calib: CalibrationSet, held: CalibrationSet | None, options: RecoverOptions, store: Store
             ) -> tuple[dict[str, Array], np.ndarray, np.ndarray, np.ndarray]:
    """All samples (calibration, then the given held-out ones) and the train / checkpoint-picking /
    verdict indices."""
    values = _arrays(calib, options.batch_size, store)
    n = len(next(iter(values.values())))
    if held is None:
        pair = getattr(calib, "flip", False) + 1
        train, held_idx = split(n, options.holdout, pair)
        return values, train, *halves(held_idx, pair)
    extra = _arrays(held, options.batch_size, store)
    if set(extra) != set(values):
        raise CalibrationError(f"the held-out samples feed {sorted(extra)} but the calibration set {sorted(values)}")
    m = len(next(iter(extra.values())))
    pair = getattr(held, "flip", False) + 1
    if n < 2 or m < 2 * pair:
        raise CalibrationError(f"{n} calibration and {m} held-out samples: give at least 2 of each "
                               "(held-out: one half picks checkpoints, the other judges)")
    both = {k: store.concat([values[k], extra[k]]) for k in values}
    return both, np.arange(n), *halves(np.arange(n, n + m), pair)


def discrepancy(student: list[np.ndarray], teacher: list[np.ndarray]) -> tuple[str, float, float | None]:
    """(metric, value, top-1 agreement): mean KL(teacher || student) of the rows as probabilities for a 2-D first
    output (a classifier), else Σ_k ||s_k - t_k||² / ||t_k - mean t_k||² over the outputs."""
    ys = [torch.from_numpy(a).double() for a in student]
    ts = [torch.from_numpy(a).double() for a in teacher]
    if teacher[0].ndim == 2:
        return "kl", float(kl_loss(ys, ts)), float((ys[0].argmax(1) == ts[0].argmax(1)).double().mean())
    return "rel_mse", float(relative_mse(ys, ts)), None


def _block_stage(s_model: onnx.ModelProto, t_graph: gs.Graph, segments: list[Segment],
                 values: dict[str, Array], train_idx: np.ndarray, held_idx: np.ndarray,
                 options: RecoverOptions, report: RecoverReport, on_progress: Progress | None, store: Store
                 ) -> tuple[onnx.ModelProto, dict[str, Array]]:
    """Train every changed segment in turn; the written model and the trained nets' outputs."""
    n = len(next(iter(values.values())))
    cur = dict(values)  # student tensors at the current anchor (all samples)
    ref = dict(values)  # teacher tensors at the same anchor
    model, trainable, done = s_model, sum(s.trainable for s in segments), 0
    for seg in segments:
        t0 = time.perf_counter()
        net = TorchGraph(s_model, outputs=seg.end, inputs_at=seg.start).to(options.torch_device())
        xs = [cur[name] for name in net.input_names]
        new_ref, _ = run_segment(t_graph, ref, seg.end, provider=options.provider, batch_size=options.batch_size,
                                 store=store)
        if seg.trainable:
            ts = [new_ref[name] for name in seg.end]
            names = set(seg.changed) if options.train == "changed" else None
            params = [p for name, p in net.named_initializers()
                      if isinstance(p, torch.nn.Parameter) and (names is None or name in names)]
            label = f"block {done + 1}/{trainable} → {seg.end[0]}"

            def step(k: int, loss: float, held: float, label: str = label) -> None:
                if on_progress is not None:
                    on_progress(label, k, options.steps, held)

            result = fit(net, params, xs, ts, train_idx, held_idx, steps=options.steps, lr=options.lr,
                         batch_size=options.batch_size, pull=options.pull, seed=options.seed + done, on_step=step)
            done += 1
            report.segments.append(SegmentReport(seg.end, sum(p.numel() for p in params), result.held_before,
                                                 result.held_after, result.best_step, time.perf_counter() - t0))
            model = write_back(model, net)
        ref = {**{k: v for k, v in ref.items() if k in values}, **new_ref}
        ys = evaluate_net(net, xs, np.arange(n), options.batch_size, store)
        cur = {**{k: v for k, v in cur.items() if k in values}, **dict(zip(seg.end, ys))}
    return model, cur


def _augmenter(model: onnx.ModelProto, options: RecoverOptions) -> tuple[str, Augment | None]:
    """Crop/flip/mix for a model with one 4-D float input, else None (and why)."""
    inits = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in inits]
    image = (len(inputs) == 1 and len(inputs[0].type.tensor_type.shape.dim) == 4
             and inputs[0].type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                           onnx.TensorProto.DOUBLE))
    if not image:
        return "none (the model does not take one batch of images)", None
    what = f"random resized crop, flip, {options.mix} ({options.layout})"
    return what, lambda xs, gen: [augment_images(xs[0], gen, options.mix, options.layout)]


def _distill_stage(model: onnx.ModelProto, teacher: onnx.ModelProto, t_graph: gs.Graph, segments: list[Segment],
                   values: dict[str, Array], train_idx: np.ndarray, held_idx: np.ndarray,
                   teacher_held: list[np.ndarray], options: RecoverOptions, on_progress: Progress | None,
                   store: Store) -> tuple[onnx.ModelProto, list[np.ndarray], DistillReport]:
    """Distillation of the head (the last ``distill_segments`` segments, reaching back to weights to train:
    ``head_start``; on cached augmented views) or of the whole model (augmented on the fly); the written model,
    its held-out outputs, the report."""
    t0 = time.perf_counter()
    first = head_start(segments, options.distill_segments, options.train == "changed")
    changed = {name for seg in segments for name in seg.changed}
    augment, transform = _augmenter(model, options)
    loss = kl_loss if teacher_held[0].ndim == 2 else relative_mse

    def step(k: int, value: float, best: float) -> None:
        if on_progress is not None:
            on_progress("distill", k, options.distill_steps, best)

    def trainable(net: TorchGraph) -> list[torch.nn.Parameter]:
        return [p for name, p in net.named_initializers()
                if isinstance(p, torch.nn.Parameter) and (options.train == "segment" or name in changed)]

    loop = {"steps": options.distill_steps, "lr": options.distill_lr, "pull": options.pull, "seed": options.seed,
            "on_step": step}
    if first is not None:
        start = segments[first].start
        net = TorchGraph(model, outputs=[o.name for o in model.graph.output], inputs_at=start)
        xs, ts, n_views = _head_views(model, t_graph, start, values, train_idx, held_idx, teacher_held, transform,
                                      options, store)
        params = trainable(net.to(options.torch_device()))
        held_part = np.arange(n_views, len(xs[0]))
        result = fit(net, params, xs, ts, np.arange(n_views), held_part, batch_size=options.batch_size, loss=loss,
                     **loop)
        held_out = evaluate_net(net, xs, held_part, options.batch_size)
    else:
        start, n_views = [i.name for i in model.graph.input], options.distill_steps * options.batch_size
        net, t_net = TorchGraph(model).to(options.torch_device()), TorchGraph(teacher).to(options.torch_device())
        t_net.requires_grad_(False)
        xs = [values[name] for name in net.input_names]
        params = trainable(net)
        result = distill(net, t_net, params, xs, train_idx,
                         lambda: discrepancy(evaluate_net(net, xs, held_idx, options.batch_size), teacher_held)[1],
                         batch_size=options.batch_size, augment=transform or (lambda xs, gen: xs), loss=loss,
                         **loop)
        held_out = evaluate_net(net, xs, held_idx, options.batch_size)
    report = DistillReport(sum(p.numel() for p in params), first is None, list(start), n_views, augment, result.held_before,
                           result.held_after, result.best_step, time.perf_counter() - t0)
    return write_back(model, net), held_out, report


def _head_views(model: onnx.ModelProto, t_graph: gs.Graph, start: list[str], values: dict[str, Array],
                train_idx: np.ndarray, held_idx: np.ndarray, teacher_held: list[np.ndarray],
                transform: Augment | None, options: RecoverOptions, store: Store
                ) -> tuple[list[Array], list[Array], int]:
    """The student's tensors at ``start`` and the teacher's outputs for ``distill_views`` augmented
    views of the training samples, followed by the held-out samples (not augmented); the view count."""
    names = [i.name for i in model.graph.input if i.name in values]
    outputs = [o.name for o in model.graph.output]
    s_graph, gen = gs.import_onnx(model), torch.Generator().manual_seed(options.seed)
    bs, views, n = options.batch_size, options.distill_views if transform else 1, len(train_idx)
    parts: list[tuple[dict[str, Array], dict[str, Array]]] = []
    for _ in range(views):  # one view of every training sample at a time
        feed = {n_: store.empty((n, *values[n_].shape[1:]), values[n_].dtype) for n_ in names}
        for s in range(0, n, bs):  # mixing stays within a batch
            batch = [torch.from_numpy(values[n_][train_idx[s : s + bs]]) for n_ in names]
            for n_, b in zip(names, transform(batch, gen) if transform else batch):
                feed[n_][s : s + len(b)] = b.numpy()
        student, _ = run_segment(s_graph, feed, start, provider=options.provider, batch_size=bs, store=store)
        teacher, _ = run_segment(t_graph, feed, outputs, provider=options.provider, batch_size=bs, store=store)
        parts.append((student, teacher))
    held_in, _ = run_segment(s_graph, {n_: store.copy(values[n_], held_idx) for n_ in names}, start,
                             provider=options.provider, batch_size=bs, store=store)
    xs = [store.concat([p[0][n_] for p in parts] + [held_in[n_]]) for n_ in start]
    ts = [store.concat([p[1][n_] for p in parts] + [t]) for n_, t in zip(outputs, teacher_held)]
    return xs, ts, views * n


def recover(
    student: onnx.ModelProto,
    teacher: onnx.ModelProto,
    calib: CalibrationSet,
    options: RecoverOptions,
    on_progress: Progress | None = None,
    held: CalibrationSet | None = None,
) -> tuple[onnx.ModelProto, RecoverReport]:
    """Recovery of ``student`` towards ``teacher`` by ``options.method``; never returns a worse model.
    ``held``: samples that choose checkpoints and judge the result (default: a split of ``calib``).

    Torch's global random state is seeded with ``options.seed`` for the run and restored after it (the
    caller's state is left as it was)."""
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(options.seed)
        return _recover(student, teacher, calib, options, on_progress, held)


def _recover(student: onnx.ModelProto, teacher: onnx.ModelProto, calib: CalibrationSet, options: RecoverOptions,
             on_progress: Progress | None, held: CalibrationSet | None) -> tuple[onnx.ModelProto, RecoverReport]:
    """``recover`` with torch's random state seeded."""
    start_time = time.perf_counter()
    s_graph, t_graph = import_graph(student), import_graph(teacher)
    segments = find_segments(s_graph, t_graph)
    s_model = infer_shapes(gs.export_onnx(s_graph))
    store = options.store()
    values, train_idx, held_idx, verdict_idx = _samples(calib, held, options, store)
    fixed = fixed_batch(gs.export_onnx(t_graph.copy()), values)
    if fixed is not None:  # training batches samples (and the torch evaluator would mix them)
        raise OnnxPruneError(f"recover trains on batches of samples, but the teacher graph fixes its batch "
                             f"({fixed.reason}): re-export it with a dynamic batch to recover the pruned model")
    outputs = [t.name for t in s_graph.outputs]

    def outputs_of(model: onnx.ModelProto, idx: np.ndarray, graph: gs.Graph | None = None) -> list[np.ndarray]:
        out, _ = run_segment(graph or gs.import_onnx(model), {name: store.copy(v, idx) for name, v in values.items()},
                             outputs, provider=options.provider, batch_size=options.batch_size)
        return [out[name] for name in outputs]

    teacher_held, teacher_verdict = outputs_of(teacher, held_idx, t_graph), outputs_of(teacher, verdict_idx, t_graph)
    report = RecoverReport(len(train_idx), len(held_idx) + len(verdict_idx), len(verdict_idx), held is not None, "",
                           0.0, 0.0, None, None, False, device=str(options.torch_device()), options=asdict(options))
    report.metric, report.before, report.agreement_before = discrepancy(outputs_of(student, verdict_idx),
                                                                        teacher_verdict)

    recovered, trained_held = s_model, None
    if options.method.block:
        recovered, cur = _block_stage(s_model, t_graph, segments, values, train_idx, held_idx, options, report,
                                      on_progress, store)
        trained_held = [cur[name][held_idx] for name in outputs]
    if options.method.distill:
        recovered, trained_held, report.distill = _distill_stage(recovered, teacher, t_graph, segments, values,
                                                                 train_idx, held_idx, teacher_held, options,
                                                                 on_progress, store)

    report.writeback_error = max(float(np.linalg.norm(o - t) / max(np.linalg.norm(o), 1e-30))
                                 for o, t in zip(outputs_of(recovered, held_idx), trained_held))
    tolerance = writeback_tolerance(options.torch_device())
    if not report.writeback_error <= tolerance:
        raise OnnxPruneError(f"recover: the written model differs from the trained weights by "
                             f"{report.writeback_error:.2e} (relative, onnxruntime vs torch on the held-out samples), "
                             f"past the tolerance {tolerance:.0e}: the weights were not written back faithfully, "
                             "no model is returned")
    _, report.after, report.agreement_after = discrepancy(outputs_of(recovered, verdict_idx), teacher_verdict)
    report.improved = report.after < report.before
    report.seconds = time.perf_counter() - start_time
    return (recovered if report.improved else student), report


__all__ = ["METHODS", "Layout", "Method", "Mix", "TRAIN", "Train", "RecoverOptions", "RecoverReport", "Segment", "recover", "writeback_tolerance"]
