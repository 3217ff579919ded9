"""The Python API: models and calibration data from what the CLI accepts, and the commands as functions.

The CLI parses its flags into these arguments and calls the same functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx

from onnxprune.analysis import Analysis, analyze as _analyze
from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess, label_from_name
from onnxprune.calib.sources import CalibrationSet, load_calibration, mirrors_by_default
from onnxprune.calib.sources import preprocess_for as _preprocess_for
from onnxprune.deploy.bench import BenchResult
from onnxprune.deploy.bench import bench_many as bench
from onnxprune.deploy.export import (
    TensorRTUnavailable, build_engine, engine_latency, have_tensorrt, prepare_for_tensorrt, trtexec_command,
)
from onnxprune.deploy.quantize import (QuantizeOptions, QuantizeReport, Step, int8_path, quantize as _quantize,
                                      quantized_nodes)
from onnxprune.errors import OnnxPruneError, OptionError
from onnxprune.deploy.evaluation import EvalResult, evaluate as _evaluate
from onnxprune.fileio import save_model
from onnxprune.ir.inputs import resolve_input_shapes
from onnxprune.ir.ort import InputSpec, model_input_specs
from onnxprune.normal import load, written
from onnxprune.pipeline import CompressReport, compress as _prune
from onnxprune.pipeline.preflight import preflight
from onnxprune.recovery import Progress, RecoverOptions, RecoverReport, recover as _recover
from onnxprune.ir.store import memory_bytes
from onnxprune.strategies import OMP, Allocator, Budget, Output, Reconstruction, Refit, Selector, options_from
from onnxprune.tasks import CONF, NMS_IOU
from onnxprune.tasks.labels import Labels
from onnxprune.torch.manifest import manifest as kept_manifest

ModelSource = Union[str, Path, onnx.ModelProto]
# A folder of images, a .npy/.npz file, 'file.py:fn' or 'package.module:fn', an array or a dict of arrays
# (samples first), an onnxruntime CalibrationDataReader, or a CalibrationSet used as it is.
CalibSource = Union[str, Path, np.ndarray, Mapping[str, np.ndarray], CalibrationSet, Any]


@dataclass
class Result:
    """A pruned or recovered model and the report of the run.

    A result of ``compress`` keeps the original model and its calibration set, so that ``recover`` can
    continue from it (the ``recovery`` report is then set)."""

    model: onnx.ModelProto
    report: CompressReport | RecoverReport | QuantizeReport
    recovery: RecoverReport | None = None
    original: onnx.ModelProto | None = field(default=None, repr=False)
    calibration: CalibrationSet | None = field(default=None, repr=False)
    preprocess: Preprocess | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.model = written(self.model)

    def save(self, path: str | Path, refuse: Iterable[str | Path] = ()) -> Path:
        """Write the model to ``path`` atomically (never a half file; never onto a path in ``refuse``). A result that
        keeps its calibration set is first run by onnxruntime on one of its samples: a model that fails there is
        not written (ModelError naming the node)."""
        sample = None if self.calibration is None else next(self.calibration.batches(1))
        return save_model(self.model, Path(path), [Path(p) for p in refuse], sample)

    def to_dict(self) -> dict:
        """The report as JSON-ready data; a compress result's has a ``recovery`` entry (None if none ran)."""
        if isinstance(self.report, CompressReport):
            return {**self.report.to_dict(), "recovery": self.recovery and self.recovery.to_dict()}
        return self.report.to_dict()

    def manifest(self) -> list[dict]:
        """The kept-channel manifest of a compress result (``torch.manifest.manifest``): per node whose weights changed, its
        torch module path, the original channels kept and its new weights (``onnxprune.torch.apply_manifest``)."""
        if self.original is None:
            raise OptionError("Result.manifest needs the model a compress result was pruned from")
        return kept_manifest(self.original, self.model)

    def quantize_beside(self, path: str | Path, options: QuantizeOptions | None = None, *,
                        refuse: Iterable[str | Path] = (), on_step: Step | None = None) -> tuple[Result, Path]:
        """The INT8 model of this compress result, whose float model is written at ``path``: quantized on its
        calibration samples against the model it was pruned from (``quantize``), written beside it (``int8_path``:
        small.onnx -> small.int8.onnx, never onto ``path`` or a path in ``refuse``); the result and where it went."""
        if self.original is None or self.calibration is None:
            raise OptionError("Result.quantize_beside continues a result of compress; quantize other models with "
                              "onnxprune.quantize(model, calib)")
        quantized = quantize(self.model, self.calibration, reference=self.original, options=options, on_step=on_step)
        beside = int8_path(Path(path))
        quantized.save(beside, refuse=[*refuse, path])
        return quantized, beside

    def recover(self, options: RecoverOptions | None = None, *, held: CalibSource | None = None,
                on_progress: Progress | None = None) -> Result:
        """Recovery of this compress result towards the model it was pruned from, on the same calibration set
        (see ``onnxprune.recover``): ``held`` samples the pruner did not see (read with the same preprocessing)
        pick the checkpoints and judge the result, else a split of the calibration set. Returns a result with
        the recovered (or, if recovery did not help, the same) model, this compress report and ``recovery``."""
        if self.original is None or self.calibration is None or not isinstance(self.report, CompressReport):
            raise OptionError("Result.recover continues a result of compress; recover other models with "
                              "onnxprune.recover(model, teacher, calib)")
        held_set = None if held is None else calibration(held, self.original, self.preprocess)
        model, report = _recover(self.model, self.original, self.calibration, options or RecoverOptions(),
                                 on_progress, held_set)
        return replace(self, model=model, recovery=report)


def preprocess_for(model: ModelSource | list[InputSpec], *, input_shape: Sequence[str] | None = None,
                   resize: int | None = None, crop: int | None = None,
                   mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
                   layout: str = "auto", bgr: bool = False) -> Preprocess:
    """The image preprocessing for ``model`` (a path, a ModelProto or its input specs): without ``crop`` the
    crop is its single input's static H,W (after ``input_shape``, see ``load``; else 224), without ``resize``
    the short side is resized to crop·256/224 (ImageNet's 256 → 224); ``mean``/``std`` (R,G,B, of pixels
    scaled to [0,1]), ``layout`` ('nchw', 'nhwc' or 'auto': read from the input's shape) and ``bgr`` (feed channels in BGR order) as in
    ``Preprocess``. ``input_shape`` only sizes the crop: the model is not changed."""
    specs = model if isinstance(model, list) else _input_specs(model, input_shape)
    return _preprocess_for(specs, resize=resize, crop=crop, mean=tuple(mean), std=tuple(std), layout=layout, bgr=bgr)


def _input_specs(model: ModelSource, input_shape: Sequence[str] | None) -> list[InputSpec]:
    """``model``'s input specs with the dims given by ``input_shape`` filled in (the batch dim as the model has
    it), without loading more than the graph."""
    specs = model_input_specs(model)
    if not input_shape:
        return specs
    source = str(model) if not isinstance(model, onnx.ModelProto) else model.graph.name or "the model"
    shapes = resolve_input_shapes(specs, input_shape, None, source)
    return [(name, [dims[0], *shapes[name][1:]] if dims else dims, dtype) for name, dims, dtype in specs]


def calibration(calib: CalibSource, model: onnx.ModelProto, preprocess: Preprocess | None = None, *,
                subset: str | None = None, limit: int | None = None, flip: bool | None = False) -> CalibrationSet:
    """The calibration set of ``calib`` for ``model``'s inputs. Images go through ``preprocess`` (default:
    ImageNet's, cropped to the input's H,W; see ``preprocess_for``); ``subset`` (e.g. '0:400', '0%5'), then
    ``limit`` pick samples; ``flip`` adds each image's mirror (None: an image folder's for a classifier,
    ``mirrors_by_default``)."""
    if flip is None:
        flip = isinstance(calib, (str, Path)) and Path(calib).is_dir() and mirrors_by_default(model)
    if isinstance(calib, CalibrationSet):
        if subset is not None or limit is not None or flip:
            raise OptionError("subset, limit and flip do not apply to a CalibrationSet: pick its samples when "
                              "building it")
        return calib
    specs = model_input_specs(model)
    return load_calibration(calib, specs, preprocess=preprocess or _preprocess_for(specs), subset=subset,
                            limit=limit, flip=flip)


def analyze(model: ModelSource, input_shape: Sequence[str] | None = None) -> Analysis:
    """The channel groups of ``model`` (a path or a ModelProto; prunable or not, with the reason), its MACs and
    parameters; ``input_shape`` fixes its dynamic dims other than the batch (see ``load``). Every prunable group is
    pruned at once in a copy and run on one random sample (``onnxprune.pipeline.preflight``): a group that breaks the run is
    not prunable, with onnxruntime's reason."""
    analysis = _analyze(load(model, input_shape))
    analysis.preflight = preflight(analysis.graph, analysis.prunable).to_dict()
    return analysis


def compress(
    model: ModelSource,
    calib: CalibSource,
    *,
    budget: Budget,
    select: Selector = OMP(),
    allocate: Allocator = Output(),
    reconstruct: Reconstruction = Refit(),
    preprocess: Preprocess | None = None,
    input_shape: Sequence[str] | None = None,
    subset: str | None = None,
    limit: int | None = None,
    flip: bool | None = None,
    round_to: int = 8,
    batch_size: int = 32,
    provider: str = "auto",
    best_effort: bool = False,
    residual_streams: bool = False,
    memory: int | str | None = None,
    spill_dir: str | Path | None = None,
    task: str = "auto",
    empty_samples: bool = False,
    on_layer: Callable[[int, int, str], None] | None = None,
) -> Result:
    """Prune ``model``'s channels to ``budget`` on the samples of ``calib``; returns the pruned model and its report.

    Arguments:
        model: the ONNX model, a path or a ModelProto.
        calib: the calibration samples: a folder of images, a .npy/.npz file, 'file.py:fn' or
            'package.module:fn' (a callable yielding samples or batches), an array or a dict of arrays
            (samples first), an onnxruntime CalibrationDataReader, or a ``CalibrationSet``.
        budget: ``MACs(count)``, ``Ratio(fraction of the original MACs)`` or ``Latency(ms=... | ratio=...)``.
        select: how the channels are picked: ``OMP()``, ``Local()``, ``Global()``, ``Auto(budget=seconds)``, ``L1()`` or
            ``Random(seed)``.
        allocate: how the widths are allocated: ``Output()`` (judged on the network's output, the default),
            ``Recoverable()`` (``Output()`` pruning the last third of the layers less, for a model ``recover`` will
            train), ``Epsilon()`` (the paper's rule on per-layer losses), ``Uniform()`` or ``Curve()``.
        reconstruct: the consumers' new weights: ``Refit()`` (least squares), ``Scale()`` or ``NoRefit()``.
        preprocess: the image preprocessing of an image folder (default: ``preprocess_for(model)``, ImageNet's
            normalisation cropped to the input's H,W).
        input_shape: shapes of the dynamic inputs (``["1x3x224x224"]`` or ``["name:1x3x320x320", ...]``); the
            written model keeps a dynamic batch dim, the other dims are fixed to these.
        subset: which samples of ``calib``: 'a:b[:s]' slice, 'k%n' (index mod n == k), either with '!' for the
            rest, joined by '&' to intersect ('!0:125&!1%5').
        limit: use at most this many samples (after ``subset``).
        flip: add each calibration image's mirror (image folders only); None: for a classifier (its first output
            2-D), whose refits fit better on twice the samples (``calib.sources.mirrors_by_default``).
        round_to: keep every pruned width a multiple of this (1 = any width); a group narrower than 4× this
            uses the largest power of two up to a quarter of its channels.
        batch_size: samples per onnxruntime/statistics batch.
        provider: onnxruntime's execution provider: 'auto', 'cpu' or 'cuda'.
        best_effort: if the budget is below the lowest reachable one, prune to that instead of raising.
        residual_streams: also prune residual streams (the channels several blocks sum with ``Add``), each
            jointly across its producers and consumers (off by default: on MobileNetV2 the output allocation
            never narrows them, the ε allocation loses accuracy with them).
        memory: bytes (or '4G', '512M') of cached activations held in RAM; past it they are spilled to files in
            ``spill_dir`` (default: half of the memory available at the start). The result does not depend on it.
        spill_dir: where spilled activations go (default: the system's temporary folder); the files are
            unlinked as soon as they are open, so nothing is left behind.
        task: how the output allocation compares the network's outputs ('auto': read from their layout, see
            ``evaluate``): a detector's class scores on every anchor plus its boxes where the original sees an
            object, a classifier's KL; 'raw': the relative squared error of the raw tensors.
        empty_samples: a detector fits and probes on every sample, also those where the original finds no object
            (default: only those with one, others evenly added up to 32; the report's ``objects`` counts them).
        on_layer: ``on_layer(i, total, label)`` is called as each group is pruned (progress).

    The result's ``recover()`` continues with few-shot recovery towards ``model`` on the same samples."""
    options = options_from(budget, select, allocate, reconstruct, round_to=round_to, batch_size=batch_size,
                           provider=provider, best_effort=best_effort, residual_streams=residual_streams,
                           memory=memory_bytes(memory), spill_dir=None if spill_dir is None else str(spill_dir),
                           task=task, empty_samples=empty_samples)
    step = on_layer or (lambda done, total, label: None)
    step(0, 0, "loading the model")
    onnx_model = load(model, input_shape)
    preprocess = preprocess or _preprocess_for(model_input_specs(onnx_model))
    step(0, 0, "reading the calibration samples")
    data = calibration(calib, onnx_model, preprocess, subset=subset, limit=limit, flip=flip)
    pruned, report = _prune(onnx_model, data, options, on_layer)
    return Result(pruned, report, original=onnx_model, calibration=data, preprocess=preprocess)


def recover(
    model: ModelSource,
    teacher: ModelSource,
    calib: CalibSource,
    *,
    options: RecoverOptions | None = None,
    held: CalibSource | None = None,
    preprocess: Preprocess | None = None,
    input_shape: Sequence[str] | None = None,
    subset: str | None = None,
    limit: int | None = None,
    flip: bool = False,
    on_progress: Progress | None = None,
) -> Result:
    """Few-shot recovery of the pruned ``model`` towards ``teacher``; never returns a worse model.

    Arguments:
        model: the pruned model (the student), a path or a ModelProto.
        teacher: the model it was pruned from.
        calib: the training samples (any source ``compress`` takes).
        options: the method ('block', 'distill' or both), steps, learning rates... (see ``RecoverOptions``).
        held: samples the pruner did not see that pick the checkpoints and judge the result (read like
            ``calib``, without ``subset``/``limit``/``flip``); default: a split of ``calib`` (``options.holdout``).
        preprocess: the image preprocessing (default: ``preprocess_for(teacher)``).
        input_shape, subset, limit: as for ``compress``; ``flip`` too, but off by default (the distillation
            mirrors its own augmented views).
        on_progress: ``on_progress(label, step, total, held_loss)`` is called as training advances.

    The recovered weights are kept only if they are closer to the teacher on the held-out samples (KL for
    classifiers); otherwise the input model is returned unchanged (see the report's ``improved``)."""
    student, teacher_model = load(model, input_shape), load(teacher, input_shape)
    data = calibration(calib, teacher_model, preprocess, subset=subset, limit=limit, flip=flip)
    held_set = None if held is None else calibration(held, teacher_model, preprocess)
    return Result(*_recover(student, teacher_model, data, options or RecoverOptions(), on_progress, held_set))


def evaluate(
    model: ModelSource,
    images: str | Path,
    reference: ModelSource | None = None,
    *,
    preprocess: Preprocess | None = None,
    input_shape: Sequence[str] | None = None,
    subset: str | None = None,
    limit: int | None = None,
    labels: Callable[[Path], int | None] = label_from_name,
    batch_size: int = 32,
    provider: str = "auto",
    task: str = "auto",
    conf: float = CONF,
    iou: float = NMS_IOU,
    truth: str | Path | None = None,
    simulate_qdq: bool = False,
) -> EvalResult:
    """The fidelity of ``model`` on a folder of images, against ``reference`` when given.

    Arguments:
        model: the model to measure, a path or a ModelProto.
        images: a folder of images (searched recursively, sorted by path).
        reference: the model it was pruned from: adds top-1 agreement and KL for a classifier, and the
            relative L2 error and cosine similarity of every output. It needs the same inputs and outputs.
        preprocess: the image preprocessing (default: ``preprocess_for(model, input_shape=input_shape)``).
        input_shape: shapes of the dynamic inputs, sizing the default preprocessing's crop.
        subset: which images: 'a:b[:s]' slice, 'k%n' (index mod n == k), either with '!' for the rest, joined by
            '&' to intersect ('!0:125&!1%5').
        limit: at most this many images (after ``subset``).
        labels: an image's class from its path, or None (default: the file name's leading number); top-1 and
            top-5 accuracy are reported when every image has one and the first output is (batch, classes).
        batch_size: images per run.
        provider: onnxruntime's execution provider: 'auto', 'cpu' or 'cuda'.
        task: how the outputs are read ('auto': from their layout; 'classify', 'detect', 'segment', 'ctc',
            'seq', 'textdet', 'raw'), for the task's metrics in ``EvalResult.metrics``: a detector's mAP50 and
            mAP50-95 against the reference's detections (``mAP50_ref``; 1.0 for the reference itself) and against
            ``truth``, a segmenter's mask IoU, a CTC recogniser's string agreement, an attention decoder's token
            sequence agreement, a text detector's region F1. Outputs whose length varies (a decoded sequence)
            are compared zero-padded to the longer (``EvalResult.padded`` names them).
        conf: a detection counts (as the reference's ground truth, and for masks) from this score.
        iou: the IoU of the detectors' non-maximum suppression.
        truth: ground-truth boxes: a folder of YOLO txt files (named as the images) or a COCO json.
        simulate_qdq: a quantized model's Q/DQ pairs run in float, as TensorRT computes, instead of onnxruntime's
            int8 kernels (whose 8-bit products saturate on x86 CPUs without VNNI).

    Returns an ``EvalResult`` (``to_dict()`` is what ``onnxprune eval --json`` prints); a metric that does not
    apply is None (or empty)."""
    return _evaluate(model, images, ref=reference, subset=subset, limit=limit, labels=labels, batch_size=batch_size,
                     preprocess=preprocess or preprocess_for(model, input_shape=input_shape), provider=provider,
                     task=task, conf=conf, iou=iou, truth=None if truth is None else Labels.load(truth),
                     simulate_qdq=simulate_qdq)


def quantize(
    model: ModelSource,
    calib: CalibSource,
    *,
    held: CalibSource | None = None,
    reference: ModelSource | None = None,
    options: QuantizeOptions | None = None,
    preprocess: Preprocess | None = None,
    input_shape: Sequence[str] | None = None,
    subset: str | None = None,
    limit: int | None = None,
    on_step: Step | None = None,
) -> Result:
    """Static INT8 quantization (QDQ, onnxruntime's tools) of ``model``, judged against ``reference``.

    Arguments:
        model: the float model (pruned or not), a path or a ModelProto; a model with quantization nodes is refused.
        calib: the calibration samples (any source ``compress`` takes).
        held: samples that choose the calibration method and the layers kept in float, and judge the result (read
            like ``calib``); default: every fifth sample of ``calib`` (after ``subset``, ``limit``), which then
            calibrates on the others.
        reference: what the model is judged against, e.g. the original it was pruned from (default: ``model``).
        options: the runtime's layout, the calibration methods tried, the ends kept in float, the sample count
            (see ``QuantizeOptions``).
        preprocess: the image preprocessing (default: ``preprocess_for(model)``).
        input_shape, subset, limit: as for ``compress``.
        on_step: ``on_step(i, total, label)`` is called as each candidate is calibrated and judged.

    Returns a ``Result`` whose ``report`` is a ``QuantizeReport``: the method chosen, the nodes left in float, every
    candidate's score, and the task metric of the float input and of the INT8 model against the reference."""
    onnx_model = load(model, input_shape)
    preprocess = preprocess or _preprocess_for(model_input_specs(onnx_model))
    data = calibration(calib, onnx_model, preprocess, subset=subset, limit=limit)
    held_set = None if held is None else calibration(held, onnx_model, preprocess)
    ref = None if reference is None else load(reference, input_shape)
    quantized, report = _quantize(onnx_model, data, held_set, reference=ref, options=options, on_step=on_step)
    if isinstance(reference, (str, Path)):
        report.reference = str(reference)
    return Result(quantized, report, calibration=data)  # save() runs the written model on one sample


@dataclass
class Exported:
    """What ``export`` wrote: the TensorRT-ready ONNX, and the engine (None without TensorRT) with its timing
    (None where it could not be timed, ``untimed`` saying why), or the ``trtexec`` command that builds it."""

    onnx: Path
    engine: Path | None = None
    timing: dict | None = None
    untimed: str | None = None
    trtexec: str | None = None


def export(model: str | Path, engine: str | Path, *, tensorrt: bool = True, fp16: bool = False,
           workspace: int = 1024, input_shape: Sequence[str] | None = None) -> Exported:
    """A TensorRT-ready copy of ``model`` (static shapes, constants folded) written beside ``engine``
    (``model.engine`` → ``model.trt.onnx``), then, with ``tensorrt``, the engine built at ``engine`` and timed.

    Arguments:
        model: the ONNX model's path.
        engine: where the engine goes; the TensorRT-ready ONNX is written beside it.
        tensorrt: build and time the engine (needs the tensorrt package); False writes only the ONNX and
            returns the ``trtexec`` command that builds the engine where TensorRT is (e.g. on a Jetson).
        fp16: allow fp16 kernels.
        workspace: the builder's workspace in MiB.
        input_shape: shapes of the dynamic inputs (``["1x3x224x224"]`` or ``["name:1x3x320x320", ...]``).

    A failure leaves no file; an engine that is built but cannot be timed (no CUDA buffer library) is kept."""
    engine = Path(engine)
    ready = engine.with_suffix(".trt.onnx")
    if tensorrt and not have_tensorrt():
        raise TensorRTUnavailable("TensorRT is not installed (pip install onnxprune[tensorrt]): export with "
                                  "tensorrt off to write only the TensorRT-ready ONNX and the trtexec command that "
                                  "builds the engine on a machine with TensorRT", option="tensorrt")
    written: list[Path] = []
    try:
        written.append(prepare_for_tensorrt(model, ready, input_shape))
        if not tensorrt:
            int8 = bool(quantized_nodes(onnx.load(str(ready))))
            return Exported(ready, trtexec=trtexec_command(ready, engine, fp16, workspace, None, int8))
        written.append(build_engine(ready, engine, fp16=fp16, workspace_mb=workspace, shapes=input_shape))
        try:
            return Exported(ready, engine, timing=engine_latency(engine))
        except TensorRTUnavailable as exc:  # the engine is built; only its timing needs CUDA buffers
            return Exported(ready, engine, untimed=str(exc))
    except OnnxPruneError:
        for path in written:  # a failed export leaves no file
            path.unlink(missing_ok=True)
        raise
