"""Static INT8 quantization (QDQ) with onnxruntime's tools, judged against the original: the calibration method,
whether the first and last weighted layers stay in float, and whether the weights' integers are the nearest or
GPTQ's (``deploy.rounding``), chosen by the task metric on held-out samples.

Two layouts, one per runtime. ``onnxruntime``: unsigned asymmetric 8-bit activations, signed symmetric per-channel
weights, int32 biases (its CPU kernels' fast path); on an x86 CPU without VNNI the weights use 7 bits, since its
8-bit products saturate there (``reduce_range``). ``tensorrt``: explicit quantization as TensorRT reads it, a
Q/DQ pair before every quantized input, signed symmetric 8-bit activations and per-channel weights, float biases;
it is judged with the Q/DQ pairs run in float (``simulate_qdq``), the arithmetic of an engine that does not
saturate."""

from __future__ import annotations

import contextlib
import io
import logging
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

from onnxprune.calib.sources import CalibrationSet
from onnxprune.deploy.rounding import gptq_weights
from onnxprune.errors import CalibrationError, ModelError, OptionError, check_choice
from onnxprune.deploy.evaluation import EvalResult, evaluate, fidelity
from onnxprune.ir.probe import fixed_batch

RUNTIMES = ("onnxruntime", "tensorrt")
METHODS = ("minmax", "percentile", "entropy")
FLOAT_ENDS = ("auto", "yes", "no")
ROUNDINGS = ("auto", "gptq", "nearest")
WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
QUANTIZED_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
                           "MatMulInteger", "DynamicQuantizeLinear"})
HELD_EVERY = 5  # without held samples, every fifth calibration sample is held out
CALIB_CHUNK = 8  # samples per calibration run: onnxruntime's calibrators hold every tensor of the samples of a run
LOSS_NOTED = 0.05  # a metric this much below the float input's is a note in the report

Step = Callable[[int, int, str], None]


@dataclass(frozen=True)
class QuantizeOptions:
    """How ``quantize`` quantizes and chooses.

    runtime: the layout ('onnxruntime' or 'tensorrt', see the module). methods: the calibration methods tried
    ('minmax', 'percentile' at 99.999%, 'entropy'). float_ends: keep the first weighted layer and the last ones
    (those no other weighted layer follows) in float: 'auto' (where that scores better on the held-out samples),
    'yes' or 'no'. samples: calibration samples at most (evenly drawn from the calibration set).
    reduce_range: 7-bit weights; None: on for 'onnxruntime' on an x86 CPU without VNNI, else off. rounding: the
    weights' integers 'nearest' to each weight, or rounded by 'gptq' (``deploy.rounding``: the layer's output error
    on the calibration samples kept small), or 'auto': the best candidate tried both ways, the better kept.
    max_loss: where the best candidate's metric lies more than this below the float input's, the first and the
    last weighted layers (2, 4, 8, ... of them at each end, at most a quarter) stay in float with every node before
    / after them, the fewest that bring it within (``prefix``; what they keep in float runs at float speed); None:
    never."""

    runtime: str = "onnxruntime"
    methods: tuple[str, ...] = METHODS
    float_ends: str = "auto"
    rounding: str = "auto"
    samples: int = 128
    reduce_range: bool | None = None
    task: str = "auto"
    batch_size: int = 32
    max_loss: float | None = None

    def __post_init__(self) -> None:
        check_choice("runtime", self.runtime, RUNTIMES)
        check_choice("float_ends", self.float_ends, FLOAT_ENDS)
        check_choice("rounding", self.rounding, ROUNDINGS)
        if not self.methods:
            raise OptionError(f"methods is empty: give one or more of {', '.join(METHODS)}", option="methods")
        for method in self.methods:
            check_choice("methods", method, METHODS)
        if self.samples < 1:
            raise OptionError(f"samples {self.samples} must be at least 1", option="samples")
        if self.max_loss is not None and not 0 < self.max_loss < 1:
            raise OptionError(f"max_loss {self.max_loss} must lie between 0 and 1 (a loss of the task metric, "
                              "e.g. 0.03)", option="max_loss")


@dataclass
class Candidate:
    """One quantized model judged on the held-out samples."""

    method: str
    float_nodes: list[str]
    metric: str
    value: float | None  # the task metric against the reference
    kl: float | None  # a classifier's KL to the reference (ties of the metric are broken by it, else by rel_l2)
    rel_l2: float  # the outputs' relative L2 error to the reference, averaged over the outputs
    seconds: float  # calibration (shared by a method's candidates, counted in its first) and quantization
    rounding: str = "nearest"  # the weights' integers: nearest, or gptq
    prefix: int = 0  # the first and the last weighted layers kept in float, with every node before / after them

    def key(self) -> tuple[float, float]:
        """Larger is better: the metric, then the smaller KL (classifiers) or relative error."""
        return (self.value if self.value is not None else float("-inf"),
                -(self.kl if self.kl is not None else self.rel_l2))


@dataclass
class QuantizeReport:
    """What ``quantize`` chose and how the written model compares with the reference."""

    runtime: str
    method: str
    rounding: str  # the weights' integers: 'nearest' or 'gptq'
    float_nodes: list[str]  # weighted nodes this run kept in float (the ends and the prefix, when they won)
    tail: list[str]  # the nodes after the last weighted ones (a head's decoding), always in float
    unquantized: list[str]  # every weighted node whose weights stay in float in the written model
    reduce_range: bool
    simulated: bool  # judged with the Q/DQ pairs run in float, not onnxruntime's int8 kernels
    metric: str
    fp32: dict  # the input model against the reference on the held-out samples: metric, spread, agreement, kl, top1
    int8: dict  # the written model, likewise
    candidates: list[Candidate]
    calibration_samples: int
    held_samples: int
    seconds: float
    reference: str = "the input model"  # what the metrics are measured against
    notes: list[str] = field(default_factory=list)
    prefix: int = 0  # the first and the last weighted layers kept in float, every node before / after (``max_loss``)

    def to_dict(self) -> dict:
        return asdict(self)


def int8_path(path: Path) -> Path:
    """Where the INT8 model of the float model written to ``path`` goes: ``small.onnx`` -> ``small.int8.onnx``."""
    return path.with_name(f"{path.stem}.int8{path.suffix or '.onnx'}")


def saturating_cpu() -> bool:
    """Whether this machine is x86 without VNNI, whose 8-bit integer products saturate in onnxruntime's kernels."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # x86 of unknown features: the safe side
    return not any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def quantized_nodes(model: onnx.ModelProto) -> list[str]:
    """The nodes of ``model`` that are quantization already (Q/DQ, QLinear*, *Integer)."""
    return [n.name or n.op_type for n in model.graph.node if n.op_type in QUANTIZED_OPS]


def _weighted(model: onnx.ModelProto) -> list[int]:
    """The indices of the nodes of ``model`` that weigh channels: a Conv, Gemm or MatMul with a constant weight."""
    constants = {t.name for t in model.graph.initializer}
    return [i for i, n in enumerate(model.graph.node)
            if n.op_type in WEIGHTED and len(n.input) > 1 and n.input[1] in constants]


def _followed(model: onnx.ModelProto, weighted: set[int]) -> list[bool]:
    """For each node of ``model`` (in topological order), whether one of the ``weighted`` nodes lies after it."""
    nodes = model.graph.node
    consumers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            consumers.setdefault(name, []).append(i)
    followed = [False] * len(nodes)
    for i in reversed(range(len(nodes))):
        followed[i] = any(c in weighted or followed[c] for o in nodes[i].output for c in consumers.get(o, []))
    return followed


def ends(model: onnx.ModelProto) -> list[str]:
    """The first weighted node and the last ones (no weighted node after them), by name."""
    weighted, nodes = _weighted(model), model.graph.node
    if not weighted:
        return []
    followed = _followed(model, set(weighted))
    return list(dict.fromkeys([nodes[weighted[0]].name, *(nodes[i].name for i in weighted if not followed[i])]))


def prefix(model: onnx.ModelProto, layers: int) -> list[str]:
    """The nodes before the weighted node after the first ``layers`` ones, in the graph's (topological) order: those
    layers, their activations and whatever else the graph computes before them, by name."""
    weighted = _weighted(model)
    stop = weighted[layers] if layers < len(weighted) else len(model.graph.node)
    return [n.name for n in model.graph.node[:stop]]


def suffix(model: onnx.ModelProto, layers: int) -> list[str]:
    """The nodes from the first of the last ``layers`` weighted ones on, in the graph's (topological) order: those
    layers, their activations and whatever else the graph computes after them, by name (none for 0 layers)."""
    weighted = _weighted(model)
    start = weighted[-layers] if 0 < layers <= len(weighted) else len(model.graph.node)
    return [n.name for n in model.graph.node[start:]]


def end_widths(model: onnx.ModelProto) -> list[int]:
    """The widths ``max_loss`` tries at each end: 2, 4, 8, ... weighted layers, at most a quarter of them."""
    quarter = len(_weighted(model)) // 4
    return [2 ** i for i in range(1, quarter.bit_length())]


def tail(model: onnx.ModelProto) -> list[str]:
    """The nodes after the last weighted ones, by name: a head's decoding (a detector's sigmoid scores beside its
    boxes in pixels, concatenated into one output; a softmax), which one 8-bit scale cannot hold."""
    weighted = set(_weighted(model))
    if not weighted:
        return []
    followed = _followed(model, weighted)
    return [n.name for i, n in enumerate(model.graph.node) if i not in weighted and not followed[i]]


def unquantized(model: onnx.ModelProto) -> list[str]:
    """The weighted nodes of a QDQ ``model`` whose weight does not come from a DequantizeLinear."""
    dequantized = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    constants = {t.name for t in model.graph.initializer}
    return [n.name for n in model.graph.node if n.op_type in WEIGHTED and len(n.input) > 1
            and n.input[1] not in dequantized and (n.input[1] in constants or n.input[1] == "")]


def named(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose every node has a unique name (what the quantizer's exclusions refer to)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    seen: set[str] = set()
    for i, node in enumerate(copy.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{i}"
        seen.add(node.name)
    return copy


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """onnxruntime's quantization tools print progress and log advice: neither reaches the user's stdout."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


class _Feeds:
    """An onnxruntime CalibrationDataReader over a list of feeds."""

    def __init__(self, feeds: list[dict]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> dict | None:
        return next(self._feeds, None)


def _method(name: str) -> CalibrationMethod:
    """onnxruntime's CalibrationMethod of ``name`` (``METHODS``)."""
    return {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
            "entropy": CalibrationMethod.Entropy}[name]


def _calibrate(model_path: Path, data: CalibrationSet, method: str, batch: int, symmetric: bool, cache: Path) -> None:
    """Ranges of every tensor to quantize, by ``method`` (``symmetric``: about 0), written to ``cache`` (onnxruntime's
    calibration cache); the samples reach the calibrator ``CALIB_CHUNK`` at a time, so that it never holds the
    tensors of more."""
    calibrator = create_calibrator(model_path, None, augmented_model_path=str(cache.with_suffix(".aug.onnx")),
                                   calibrate_method=_method(method), extra_options={"symmetric": symmetric},
                                   providers=["CPUExecutionProvider"])
    chunk: list[dict] = []
    for feed in data.batches(batch):
        chunk.append(feed)
        if len(chunk) * batch >= CALIB_CHUNK:
            calibrator.collect_data(_Feeds(chunk))
            chunk = []
    if chunk:
        calibrator.collect_data(_Feeds(chunk))
    save_tensors_data(calibrator.compute_data(), cache)


def _quantize(model_path: Path, out: Path, method: str, cache: Path, exclude: list[str], runtime: str,
              reduce_range: bool) -> onnx.ModelProto:
    """The QDQ model of ``runtime``'s layout with the calibrated ranges of ``cache``, ``exclude`` left in float.
    TensorRT's: a Q/DQ pair before the inputs of the weighted ops only, where an engine quantizes (it runs the
    activations and adds between them in its kernels' epilogues); a pair on every output as well, on a Sigmoid's,
    a Mul's, a Concat's, rounds each to a symmetric 8-bit range again (the person detector at 0.85x: 0.75 of the
    original's mAP50-95 so, 0.83 with the weighted inputs only)."""
    tensorrt = runtime == "tensorrt"
    weighted = sorted(WEIGHTED) if tensorrt else None
    quantize_static(str(model_path), str(out), None, quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=reduce_range, activation_type=QuantType.QInt8 if tensorrt else QuantType.QUInt8,
                    weight_type=QuantType.QInt8, nodes_to_exclude=exclude, calibrate_method=_method(method),
                    calibration_cache_path=str(cache), op_types_to_quantize=weighted,
                    extra_options={"WeightSymmetric": True, "ActivationSymmetric": tensorrt,
                                   "QuantizeBias": not tensorrt, "OpTypesToExcludeOutputQuantization": weighted or []})
    return onnx.load(str(out))


def _summary(result: EvalResult) -> dict:
    metric, value = fidelity(result)
    return {"metric": metric, "value": value, "spread": result.spread.get(metric), "agreement": result.agreement,
            "kl": result.kl, "top1": result.top1, "rel_l2": result.rel_l2}


def quantize(model: onnx.ModelProto, data: CalibrationSet, held: CalibrationSet | None = None, *,
             reference: onnx.ModelProto | None = None, options: QuantizeOptions | None = None,
             on_step: Step | None = None) -> tuple[onnx.ModelProto, QuantizeReport]:
    """The INT8 (QDQ) model of ``model`` calibrated on ``data`` (at most ``options.samples`` of it, evenly drawn)
    and its report; without ``held`` samples, every fifth sample of ``data`` is held out instead (``split``). Each
    calibration method is tried, then, with ``float_ends`` 'auto', the best one with the first and last weighted
    layers kept in float, then, with ``rounding`` 'auto', the best so far with GPTQ's integers; the candidate whose
    task metric against ``reference`` (default: the input model) on the ``held`` samples is best is returned (ties:
    the smaller KL or output error). With ``max_loss``, where that candidate loses more than it to the float input,
    wider float ends (``end_widths``: the first and the last layers) follow until one is within it; the narrowest
    within it is returned. The nodes after the last weighted layers (``tail``) always stay in float."""
    options = options or QuantizeOptions()
    start = time.perf_counter()
    done = quantized_nodes(model)
    if done:
        raise ModelError(f"the model is quantized already ({len(done)} quantization nodes, e.g. {done[0]!r}): give "
                         "quantize the float model")
    model = named(model)
    judged_against = "the input model" if reference is None else "the reference model"
    decoding = tail(model)
    reference = reference or model
    if held is None:
        data, held = split(data)
    tensorrt = options.runtime == "tensorrt"
    reduce_range = (not tensorrt and saturating_cpu()) if options.reduce_range is None else options.reduce_range
    sample = next(data.batches(2))
    fixed = fixed_batch(model, sample)
    batch = fixed.size if fixed is not None else min(options.batch_size, CALIB_CHUNK)
    calib = _drawn(data, options.samples)
    trials = len(options.methods) + (options.float_ends != "no") + (options.rounding != "nearest")
    widths = end_widths(model) if options.max_loss is not None else []
    trials += len(widths)
    step = on_step or (lambda i, n, text: None)
    weighted = {model.graph.node[i].name for i in _weighted(model)}

    def judge(candidate: onnx.ModelProto, quantized: bool = True) -> EvalResult:
        return evaluate(candidate, held, ref=reference, batch_size=options.batch_size, provider="cpu",
                        task=options.task, simulate_qdq=tensorrt and quantized)

    candidates: list[tuple[Candidate, onnx.ModelProto, EvalResult]] = []
    tried = 0  # trials run (``candidates`` keeps only those still to choose from)
    with tempfile.TemporaryDirectory(prefix="onnxprune-quantize-") as tmp, _quiet():
        model_path = Path(tmp) / "model.onnx"
        onnx.save(model, str(model_path))
        caches: dict[str, Path] = {}

        def trial(method: str, exclude: list[str], rounding: str = "nearest", layers: int = 0) -> None:
            nonlocal tried
            t0 = time.perf_counter()
            step(tried, trials, f"{method}{' (ends in float)' if exclude else ''}"
                                          f"{', gptq rounding' if rounding == 'gptq' else ''}"
                                          f"{f', first and last {layers} layers in float' if layers else ''}")
            in_float = list(dict.fromkeys([*prefix(model, layers), *suffix(model, layers), *exclude])) \
                if layers else exclude
            if method not in caches:
                caches[method] = Path(tmp) / f"{method}.json"
                _calibrate(model_path, calib, method, batch, tensorrt, caches[method])
            q = _quantize(model_path, Path(tmp) / f"{method}-{tried}.onnx", method, caches[method],
                          [*in_float, *decoding], options.runtime, reduce_range)
            if rounding == "gptq":
                gptq_weights(q, model, lambda: calib.batches(batch))
            scores = judge(q)
            metric, value = fidelity(scores)
            rel = sum(scores.rel_l2.values()) / max(len(scores.rel_l2), 1)
            candidates.append((Candidate(method, [n for n in in_float if n in weighted], metric, value, scores.kl, rel,
                                         time.perf_counter() - t0, rounding, layers), q, scores))
            tried += 1

        for method in options.methods:
            trial(method, [])
        best = max(candidates, key=lambda c: c[0].key())[0]
        if options.float_ends != "no":
            trial(best.method, ends(model))
            if options.float_ends == "yes":
                candidates = candidates[-1:]
        if options.rounding != "nearest":
            best = max(candidates, key=lambda c: c[0].key())[0]
            trial(best.method, best.float_nodes, "gptq")
            if options.rounding == "gptq":
                candidates = candidates[-1:]
        step(tried, trials, "judging the input model")
        fp32 = _summary(judge(model, quantized=False))
        best = max(candidates, key=lambda c: c[0].key())[0]
        ends_kept = best.float_nodes
        for layers in widths:
            if fp32["value"] is None or best.value is None or best.value >= fp32["value"] - options.max_loss:
                break
            trial(best.method, ends_kept, best.rounding, layers)
            best = candidates[-1][0]
        within = [c for c in candidates if options.max_loss is not None and fp32["value"] is not None
                  and c[0].value is not None and c[0].value >= fp32["value"] - options.max_loss]
        chosen, written, scores = (min(within, key=lambda c: (c[0].prefix, [-k for k in c[0].key()])) if within
                                   else max(candidates, key=lambda c: c[0].key()))
        int8 = _summary(scores)  # as its trial judged it
    report = QuantizeReport(
        options.runtime, chosen.method, chosen.rounding, chosen.float_nodes, decoding, unquantized(written),
        reduce_range, tensorrt, chosen.metric, fp32, int8, [c for c, _, _ in candidates], len(calib), len(held),
        time.perf_counter() - start, judged_against, prefix=chosen.prefix)
    if options.max_loss is not None and fp32["value"] is not None and not within:
        report.notes.append(f"no candidate came within --max-loss {options.max_loss:g} of the float input's "
                            f"{chosen.metric} {fp32['value']:.4f} on the held-out samples, with up to "
                            f"{max(widths, default=0)} first and last layers in float: the best is written")
    if fp32["value"] is not None and int8["value"] is not None and int8["value"] < fp32["value"] - LOSS_NOTED:
        report.notes.append(f"the INT8 model keeps {chosen.metric} {int8['value']:.4f} where the float input has "
                            f"{fp32['value']:.4f}: keep the first layers in float where that loss is too much "
                            "(--max-loss), try the other --runtime's layout, or give more calibration images")
    if reduce_range and options.reduce_range is None:
        report.notes.append("weights in 7 bits: this x86 CPU has no VNNI, and onnxruntime's 8-bit products saturate "
                            "on it (reduce_range)")
    return written, report


def split(data: CalibrationSet, every: int = HELD_EVERY) -> tuple[CalibrationSet, CalibrationSet]:
    """``data`` less every ``every``-th sample, and those samples (the first of each run of ``every``); an image and
    its mirror (``--flip``) count as one sample, held out together."""
    pair = 2 if getattr(data, "flip", False) else 1
    if len(data) < 2 * pair:
        raise CalibrationError(f"{len(data) // pair} calibration sample: quantize needs at least 2, some to calibrate "
                               "on and some held out to judge by (or give held samples)", option="calib")
    held = [i for i in range(len(data)) if i // pair % every == 0]
    return data.take([i for i in range(len(data)) if i // pair % every]), data.take(held)


def _drawn(data: CalibrationSet, samples: int) -> CalibrationSet:
    """At most ``samples`` of ``data``, evenly spaced."""
    n = len(data)
    if n <= samples:
        return data
    return data.take(sorted(set(np.linspace(0, n - 1, samples).round().astype(int).tolist())))
