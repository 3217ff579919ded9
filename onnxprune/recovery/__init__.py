"""``recover``: few-shot recovery of a pruned model from its teacher on unlabeled calibration data.

Block-wise reconstruction (the default): the student is cut at the tensors it shares with the
teacher (see ``segments``); going from the input, each segment whose weights were changed by
pruning is trained to reproduce the teacher's tensor at its end from the student's own tensor at
its start, so it also corrects the error of the segments before it. A held-out part of the
calibration set picks the best checkpoint of every segment, and the recovered model is returned
only if it agrees better with the teacher (KL on the held-out part) than the input did.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.analysis.graph import import_graph, infer_shapes
from onnxprune.calib.sources import CalibrationSet
from onnxprune.errors import CalibrationError
from onnxprune.recovery.segments import Segment, find_segments
from onnxprune.recovery.train import evaluate_net, fit, relative_mse
from onnxprune.runtime.segments import run_segment
from onnxprune.runtime.torch_eval import TorchGraph, write_back

TRAIN = ("segment", "changed")


@dataclass
class RecoverOptions:
    steps: int = 200  # Adam steps per trainable segment
    lr: float = 1e-3
    batch_size: int = 32
    holdout: float = 0.2  # fraction of the calibration samples kept aside to choose checkpoints
    train: str = "segment"  # every float weight of a changed segment, or only the changed ones
    pull: float = 0.0  # decay towards the starting weights
    seed: int = 0
    provider: str = "auto"  # onnxruntime provider computing the teacher's tensors


@dataclass
class SegmentReport:
    end: list[str]
    parameters: int
    held_before: float
    held_after: float
    best_step: int
    seconds: float


@dataclass
class RecoverReport:
    samples_train: int
    samples_held: int
    metric: str  # "kl" (KL(teacher || student) of softmax, 2-D outputs) or "rel_mse" (other outputs)
    before: float  # held-out metric of the input model
    after: float  # ... of the recovered weights (returned only if lower)
    agreement_before: float | None  # top-1 agreement with the teacher on the held-out part (classifiers)
    agreement_after: float | None
    improved: bool  # False: the input model was returned unchanged
    writeback_error: float = 0.0  # relative difference, onnxruntime on the written model vs the trained torch
    seconds: float = 0.0
    options: dict = field(default_factory=dict)
    segments: list[SegmentReport] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _arrays(calib: CalibrationSet, batch_size: int) -> dict[str, np.ndarray]:
    parts: dict[str, list[np.ndarray]] = {}
    for batch in calib.batches(batch_size):
        for name, array in batch.items():
            parts.setdefault(name, []).append(array)
    if not parts:
        raise CalibrationError("the calibration set is empty: give a folder or file with samples")
    return {name: np.concatenate(a) for name, a in parts.items()}


def split(n: int, holdout: float, pair: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Every ⌈1/holdout⌉-th block of ``pair`` samples (an image and its mirror) is held out."""
    if not 0 < holdout < 1:
        raise CalibrationError(f"holdout must be between 0 and 1, got {holdout}")
    every = max(2, round(1 / holdout))
    block = np.arange(n) // pair
    held = block % every == every - 1
    if held.sum() < 2 or (~held).sum() < 2:
        raise CalibrationError(f"{n} calibration samples are too few to hold out {holdout:.0%}: give at least "
                               f"{2 * every * pair} samples")
    return np.flatnonzero(~held), np.flatnonzero(held)


def discrepancy(student: list[np.ndarray], teacher: list[np.ndarray]) -> tuple[str, float, float | None]:
    """(metric, value, top-1 agreement): mean KL(softmax(teacher) || softmax(student)) for a 2-D first
    output (a classifier), else Σ_k ||s_k - t_k||² / ||t_k - mean t_k||² over the outputs."""
    if teacher[0].ndim == 2:
        s, t = torch.from_numpy(student[0]).double(), torch.from_numpy(teacher[0]).double()
        ls, lt = torch.log_softmax(s, 1), torch.log_softmax(t, 1)
        kl = float((lt.exp() * (lt - ls)).sum(1).mean())
        return "kl", kl, float((s.argmax(1) == t.argmax(1)).double().mean())
    ys = [torch.from_numpy(a).double() for a in student]
    return "rel_mse", float(relative_mse(ys, [torch.from_numpy(a).double() for a in teacher])), None


def recover(
    student: onnx.ModelProto,
    teacher: onnx.ModelProto,
    calib: CalibrationSet,
    options: RecoverOptions,
    on_progress: Callable[[str, int, int, float | None], None] | None = None,
) -> tuple[onnx.ModelProto, RecoverReport]:
    """Block-wise reconstruction of ``student`` towards ``teacher``; never returns a worse model."""
    if options.train not in TRAIN:
        raise ValueError(f"train {options.train!r} not in {TRAIN}")
    start_time = time.perf_counter()
    torch.manual_seed(options.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    s_graph, t_graph = import_graph(student), import_graph(teacher)
    segments = find_segments(s_graph, t_graph)
    s_model = infer_shapes(gs.export_onnx(s_graph))
    values = _arrays(calib, options.batch_size)
    n = len(next(iter(values.values())))
    train_idx, held_idx = split(n, options.holdout, pair=getattr(calib, "flip", False) + 1)
    outputs = [t.name for t in s_graph.outputs]

    cur = dict(values)  # student tensors at the current anchor (all samples)
    ref = dict(values)  # teacher tensors at the same anchor
    report = RecoverReport(len(train_idx), len(held_idx), "", 0.0, 0.0, None, None, False, options=asdict(options))
    nets = []
    trainable = sum(s.trainable for s in segments)
    done = 0
    for seg in segments:
        t0 = time.perf_counter()
        net = TorchGraph(s_model, outputs=seg.end, inputs_at=seg.start)
        xs = [cur[name] for name in net.input_names]
        new_ref, _ = run_segment(t_graph, ref, seg.end, provider=options.provider, batch_size=options.batch_size)
        if seg.trainable:
            ts = [new_ref[name] for name in seg.end]
            names = set(seg.changed) if options.train == "changed" else None
            params = [p for name, p in net.named_initializers()
                      if isinstance(p, torch.nn.Parameter) and (names is None or name in names)]
            label = f"segment {done + 1}/{trainable} → {seg.end[0]}"

            def step(k: int, loss: float, held: float, label: str = label) -> None:
                if on_progress is not None:
                    on_progress(label, k, options.steps, held)

            result = fit(net, params, xs, ts, train_idx, held_idx, steps=options.steps, lr=options.lr,
                         batch_size=options.batch_size, pull=options.pull, seed=options.seed + done, on_step=step)
            done += 1
            report.segments.append(SegmentReport(seg.end, sum(p.numel() for p in params), result.held_before,
                                                 result.held_after, result.best_step, time.perf_counter() - t0))
        ref = {**{k: v for k, v in ref.items() if k in values}, **new_ref}
        ys = evaluate_net(net, xs, np.arange(n), options.batch_size)
        cur = {**{k: v for k, v in cur.items() if k in values}, **dict(zip(seg.end, ys))}
        nets.append(net)

    recovered = s_model
    for net in nets:
        recovered = write_back(recovered, net)
    held = {name: v[held_idx] for name, v in values.items()}

    def outputs_of(model: onnx.ModelProto) -> list[np.ndarray]:
        out, _ = run_segment(gs.import_onnx(model), dict(held), outputs, provider=options.provider,
                             batch_size=options.batch_size)
        return [out[name] for name in outputs]

    teacher_held = [ref[name][held_idx] for name in outputs]
    report.metric, report.before, report.agreement_before = discrepancy(outputs_of(student), teacher_held)
    recovered_held = outputs_of(recovered)
    _, report.after, report.agreement_after = discrepancy(recovered_held, teacher_held)
    report.writeback_error = max(float(np.linalg.norm(o - cur[name][held_idx]) / max(np.linalg.norm(o), 1e-30))
                                 for name, o in zip(outputs, recovered_held))
    report.improved = report.after < report.before
    report.seconds = time.perf_counter() - start_time
    return (recovered if report.improved else student), report


__all__ = ["TRAIN", "RecoverOptions", "RecoverReport", "Segment", "recover"]
