"""Fidelity evaluation of a (pruned) model on an image folder: accuracy and agreement with a reference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx
import onnxruntime as ort

from onnxprune.calib.images import Preprocess, label_from_name
from onnxprune.calib.sources import CalibrationSet, load_image_folder
from onnxprune.errors import OnnxPruneError
from onnxprune.ir.ort import make_session, model_input_specs, run_session, zero_pad
from onnxprune.ir.probe import fixed_batch
from onnxprune.tasks import CONF, NMS_IOU, Task, image_hw, log_probs, task_named
from onnxprune.tasks.labels import Labels

EPS = 1e-12
SAME_ORIGIN = "compare against the model this one was pruned from"
# the task metric a model is judged by against its original: the first ``evaluate`` reports, else a classifier's
# agreement, else the mean cosine (``fidelity``)
FIDELITY = ("mAP50-95_ref", "mask_iou_ref", "string_agreement_ref", "sequence_agreement_ref", "region_f1_ref")
Model = Union[str, Path, onnx.ModelProto]


@dataclass
class EvalResult:
    """Metrics over ``images`` images; ``None``/empty where they do not apply (no labels, no ref, no classifier)."""

    images: int
    provider: str
    top1: float | None = None
    top5: float | None = None
    agreement: float | None = None
    kl: float | None = None
    rel_l2: dict[str, float] = field(default_factory=dict)  # sqrt(sum ||y - r||^2 / sum ||r||^2) over all images
    cosine: dict[str, float] = field(default_factory=dict)
    task: str | None = None  # what the outputs were read as (``onnxprune.tasks``)
    metrics: dict[str, float | None] = field(default_factory=dict)  # the task's scores (mAP50_ref, ...)
    # standard deviation over the images of a score (top1, agreement, kl, a task's mAP50-95_ref, ...): what a
    # bootstrap of the images gives (in closed form for a mean over images)
    spread: dict[str, float] = field(default_factory=dict)
    padded: list[str] = field(default_factory=list)  # outputs of varying length, compared zero-padded to the longer

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def evaluate(
    model: Model,
    images: str | Path | CalibrationSet,
    *,
    ref: Model | None = None,
    preprocess: Preprocess | None = None,
    subset: str | None = None,
    limit: int | None = None,
    labels: Callable[[Path], int | None] = label_from_name,
    batch_size: int = 32,
    provider: str = "auto",
    task: str = "auto",
    conf: float = CONF,
    iou: float = NMS_IOU,
    truth: Labels | None = None,
    simulate_qdq: bool = False,
) -> EvalResult:
    """Run ``model`` (a path or a ModelProto) on the images in ``images`` (after ``subset``, then the first
    ``limit``), or on the samples of a ``CalibrationSet`` (labelled when it reads an image folder), and measure it.

    If the first output is 2-D (batch, classes) and ``labels`` gives every image's class (by default the
    leading number of its file name), top-1/top-5 accuracy; with ``ref``, top-1 agreement and mean
    KL(ref || model) of their probabilities (softmax of logits, or the rows themselves when they are
    probabilities already) for such a classifier, and for every output the relative L2 error over
    the whole set (the error's energy over the reference's, so an image whose reference is ~0, e.g. a text
    detector's map of a photo without text, does not blow it up) and the mean cosine similarity per image.
    ``task`` ('auto': read from the outputs' layout, see ``onnxprune.tasks``) adds the task's metrics: a
    detector's mAP against the reference's detections of score ≥ ``conf`` (NMS at ``iou``) and against
    ``truth`` (boxes from label files), a segmenter's mask IoU, a CTC recogniser's string agreement, a text
    detector's region F1. ``simulate_qdq``: a quantized model's Q/DQ pairs run in float (``make_session``).
    """
    session, active = make_session(model, provider, simulate_qdq=simulate_qdq)
    ref_session = None
    if ref is not None:
        ref_session, _ = make_session(ref, provider)
        _check_compatible(session, ref_session, _name(model), _name(ref))
    if isinstance(images, CalibrationSet):  # an image folder's set has its paths (the labels), unless flipped
        data, paths = images, getattr(images, "paths", None)
        paths = paths if paths is not None and len(paths) == len(data) else None
    else:
        data = load_image_folder(images, model_input_specs(model), preprocess=preprocess, subset=subset, limit=limit)
        paths = data.paths
    sample = next(data.batches(2))
    batch, ref_batch = (_batch_of(m, sample) for m in (model, ref))
    classes = [None] if paths is None else [labels(p) for p in paths]
    boxes = None if truth is None or paths is None else truth.for_images(paths, preprocess)
    names = [o.name for o in session.get_outputs()]
    hits1 = hits5 = agree = 0
    kl = kl_sq = 0.0
    err = dict.fromkeys(names, 0.0)
    energy = dict.fromkeys(names, 0.0)
    cos = dict.fromkeys(names, 0.0)
    classifier = False
    padded: set[str] = set()
    reader: Task | None = None
    metric = None
    offset = 0
    for feed in data.batches(batch_size):
        ys = run_session(session, feed, batch)
        n = len(next(iter(feed.values())))
        refs = None if ref_session is None else run_session(ref_session, feed, ref_batch)
        if reader is None:
            reader = task_named(task, refs or ys, image_hw(next(iter(feed.values()))), n)
            metric = reader.metric()
        classifier = reader.name == "classify"
        if classifier and None not in classes:
            top1, top5 = _hits(ys[0], np.asarray(classes[offset : offset + n]))
            hits1, hits5 = hits1 + top1, hits5 + top5
        if refs is not None:
            for name, y, r in zip(names, ys, refs):
                if y.shape != r.shape:
                    if not _varying(name, y.shape, r.shape, session, ref_session):
                        raise _mismatch(name, y.shape, r.shape, _name(model), _name(ref))
                    y, r = zero_pad(y, r)
                    padded.add(name)
                err_sq, ref_sq, cos_sum = _similarity(y, r)
                err[name] += err_sq
                energy[name] += ref_sq
                cos[name] += cos_sum
            if classifier:
                agree += int((ys[0].argmax(axis=1) == refs[0].argmax(axis=1)).sum())
                log_p, log_q = log_probs(refs[0]), log_probs(ys[0])
                per_image = (np.exp(log_p) * (log_p - log_q)).sum(axis=1)
                kl, kl_sq = kl + float(per_image.sum()), kl_sq + float(np.square(per_image).sum())
        if metric is not None:
            metric.update(ys, refs, None if boxes is None else boxes[offset : offset + n])
        offset += n
    result = EvalResult(images=offset, provider=active, task=reader.name if reader else None,
                        metrics=metric.result() if metric is not None else {},
                        spread=metric.spread() if metric is not None else {}, padded=sorted(padded))
    if classifier and None not in classes:
        result.top1, result.top5 = hits1 / offset, hits5 / offset
    if ref_session is not None:
        result.rel_l2 = {k: float(np.sqrt(err[k] / max(energy[k], EPS))) for k in names}
        result.cosine = {k: v / offset for k, v in cos.items()}
        if classifier:
            result.agreement, result.kl = agree / offset, kl / offset
            result.spread["kl"] = float(np.sqrt(max(kl_sq / offset - result.kl**2, 0.0) / offset))
    for name in ("top1", "top5", "agreement"):
        share = getattr(result, name)
        if share is not None:
            result.spread[name] = float(np.sqrt(share * (1 - share) / offset))
    return result


def fidelity(result: EvalResult) -> tuple[str, float | None]:
    """The task metric of ``result`` against the original (see ``FIDELITY``)."""
    for name in FIDELITY:
        if result.metrics.get(name) is not None:
            return name, result.metrics[name]
    if result.agreement is not None:
        return "agreement", result.agreement
    cosines = list(result.cosine.values())
    return "cosine", (sum(cosines) / len(cosines) if cosines else None)


def _name(model: Model) -> str:
    """How messages name ``model``: its path, or its graph's name."""
    if isinstance(model, onnx.ModelProto):
        return f"the in-memory model {model.graph.name!r}" if model.graph.name else "the in-memory model"
    return str(model)


def _batch_of(model: Model | None, sample: dict[str, np.ndarray]) -> int | None:
    """The batch ``model`` must run at (see ``fixed_batch``), None when it batches freely."""
    if model is None:
        return None
    fixed = fixed_batch(model if isinstance(model, onnx.ModelProto) else onnx.load(str(model)), sample)
    return None if fixed is None else fixed.size


def _hits(logits: np.ndarray, labels: np.ndarray) -> tuple[int, int]:
    """How many rows have their label as top-1 and within the top-5 scores."""
    top5 = np.argsort(-logits, axis=1)[:, :5]
    return int((top5[:, 0] == labels).sum()), int((top5 == labels[:, None]).any(axis=1).sum())


def _similarity(y: np.ndarray, r: np.ndarray) -> tuple[float, float, float]:
    """Sums over the batch of ||y - r||², ||r||² and the per-sample cosine similarity."""
    y, r = y.reshape(len(y), -1).astype(np.float64), r.reshape(len(r), -1).astype(np.float64)
    ny, nr = np.linalg.norm(y, axis=1), np.linalg.norm(r, axis=1)
    cos = (y * r).sum(axis=1) / np.maximum(ny * nr, EPS)
    return float(((y - r) ** 2).sum()), float((nr**2).sum()), float(cos.sum())


def _varying(name: str, ours: tuple[int, ...], theirs: tuple[int, ...], *sessions: ort.InferenceSession) -> bool:
    """Whether output ``name`` differs between two runs only on axes past the batch that both models declare
    dynamic (a decoded sequence's length), so the two can be lined up."""
    declared = [next(o.shape for o in s.get_outputs() if o.name == name) for s in sessions]
    if len(ours) != len(theirs) or ours[0] != theirs[0] or any(len(d) != len(ours) for d in declared):
        return False
    return all(a == b or not any(isinstance(d[i], int) for d in declared)
               for i, (a, b) in enumerate(zip(ours, theirs)))


def _mismatch(name: str, ours: object, theirs: object, model: str | Path, ref: str | Path) -> OnnxPruneError:
    """The error for an output whose shape differs between ``model`` and ``ref``."""
    return OnnxPruneError(f"output {name!r} is {ours} in {model} but {theirs} in {ref}: {SAME_ORIGIN}")


def _check_compatible(
    session: ort.InferenceSession, ref_session: ort.InferenceSession, model: str | Path, ref: str | Path
) -> None:
    """OnnxPruneError unless ``ref`` has the same input and output names as ``model`` (output shapes are compared
    as they come out: exporters declare wrong ones, e.g. ddddocr's [1, seqlen] for a [seq, 1, classes] output)."""
    for kind, ours, theirs in (
        ("inputs", session.get_inputs(), ref_session.get_inputs()),
        ("outputs", session.get_outputs(), ref_session.get_outputs()),
    ):
        a, b = [v.name for v in ours], [v.name for v in theirs]
        if a != b:
            raise OnnxPruneError(f"{kind} of {model} ({', '.join(a)}) differ from those of {ref} ({', '.join(b)}): "
                                 f"{SAME_ORIGIN}")
