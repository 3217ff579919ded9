"""onnxruntime sessions: provider choice that verifies what really runs, input/output specs."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import onnxruntime as ort
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from onnxprune.errors import ModelError, OnnxPruneError
from onnxprune.ir.graph import constants_aside, large_constants, rebuilt

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
TENSORRT = "TensorrtExecutionProvider"
# Each explicit choice with its fallbacks for nodes the first provider cannot run.
PROVIDER_CHAINS = {"cpu": [CPU], "cuda": [CUDA, CPU], "tensorrt": [TENSORRT, CUDA, CPU]}

ModelLike = onnx.ModelProto | bytes | str | Path
InputSpec = tuple[str, list[int | str | None], np.dtype]


def available_providers() -> list[str]:
    """The execution providers this onnxruntime build offers."""
    return list(ort.get_available_providers())


def _chain(provider: str) -> list[str]:
    """The provider list to request for ``provider`` ("auto", "cpu", "cuda", "tensorrt")."""
    if provider == "auto":
        return PROVIDER_CHAINS["cuda"] if CUDA in available_providers() else PROVIDER_CHAINS["cpu"]
    if provider not in PROVIDER_CHAINS:
        raise OnnxPruneError(f"unknown provider {provider!r}: use auto, cpu, cuda or tensorrt", option="provider")
    chain = PROVIDER_CHAINS[provider]
    if chain[0] not in available_providers():
        raise OnnxPruneError(
            f"{chain[0]} is not available in this onnxruntime (has {', '.join(available_providers())}): "
            "install onnxruntime-gpu with a matching CUDA, or use the cpu provider", option="provider"
        )
    return [p for p in chain if p in available_providers()]


def first_provider(provider: str) -> str:
    """The execution provider a session for ``provider`` ("auto", "cpu", ...) runs on, unless onnxruntime falls back."""
    return _chain(provider)[0]


WEIGHT_BYTES = 1 << 20
"""From this size an initializer reaches onnxruntime as an array beside the model's bytes (``make_session``)."""


def in_memory(name: str, data_type: int, dims: Sequence[int], nbytes: int) -> onnx.TensorProto:
    """A stub for an initializer whose data onnxruntime takes from the session options (``add_external_initializers``),
    and onnx's shape inference reads only as a type and shape."""
    stub = onnx.TensorProto(name=name, dims=list(dims), data_type=data_type, data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", "onnxprune-in-memory"), ("offset", "0"), ("length", str(nbytes))):
        stub.external_data.add(key=key, value=value)
    return stub


def held_bytes(tensor: onnx.TensorProto) -> int:
    """The bytes of an initializer's values held in the model (0: external data, or strings)."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.data_type == onnx.TensorProto.STRING:
        return 0
    return int(np.prod(tensor.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def stubbed(model: onnx.ModelProto, names: Collection[str]) -> onnx.ModelProto:
    """``model`` with its initializers ``names`` as in-memory stubs (``in_memory``), the others as they are."""
    return rebuilt(model, [t if t.name not in names else in_memory(t.name, t.data_type, t.dims, held_bytes(t))
                           for t in model.graph.initializer])


def weights_aside(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``model`` with its initializers of ``WEIGHT_BYTES`` or more as in-memory stubs, and their arrays."""
    heavy = [t for t in model.graph.initializer if held_bytes(t) >= WEIGHT_BYTES]
    if not heavy:
        return model, {}
    return stubbed(model, {t.name for t in heavy}), {t.name: numpy_helper.to_array(t) for t in heavy}


def graph_session(graph: gs.Graph, provider: str = "auto", **options) -> tuple[ort.InferenceSession, str]:
    """``make_session`` of a graph-surgeon graph, its large constants handed to onnxruntime as the arrays they are
    (``light_export``)."""
    return session_of(*light_export(graph), provider, **options)


def light_export(graph: gs.Graph) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``graph`` exported with its constants of ``WEIGHT_BYTES`` or more as in-memory stubs, and their arrays (for
    ``session_of`` or a ``weights=`` argument): exporting each into a TensorProto, serialising the model and
    onnxruntime's parsing copy them four times (about a second a session for VGG-11's 530 MB, dozens of sessions in a
    ``compress``). Constants read inside subgraphs are exported as usual."""
    heavy = large_constants(graph, WEIGHT_BYTES)
    with constants_aside(heavy.values()):
        model = gs.export_onnx(graph)
    keep = [v for v in model.graph.value_info if v.name not in heavy]
    del model.graph.value_info[:]
    model.graph.value_info.extend(keep)
    arrays = {name: np.asarray(t.values) for name, t in heavy.items()}  # .values loads lazy ones
    model.graph.initializer.extend(in_memory(name, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape, a.nbytes)
                                   for name, a in arrays.items())
    return model, arrays


def make_session(
    model: ModelLike, provider: str = "auto", threads: int | None = None, spinning: bool = True, arena: bool = True,
    spin_between_runs: bool = True, quiet: bool = False, prepack: bool = True, simulate_qdq: bool = False,
) -> tuple[ort.InferenceSession, str]:
    """An InferenceSession for ``model`` and the provider that actually runs it.

    "auto" prefers CUDA and falls back to CPU; an explicit non-CPU provider that does not become
    active (onnxruntime-gpu silently falls back) raises OnnxPruneError. ``threads`` sets the
    intra-op thread count; ``spinning=False`` lets its threads sleep between nodes and runs instead of
    busy-waiting; ``spin_between_runs=False`` keeps onnxruntime's spinning between the nodes of a run
    but stops it when a run returns (what timing several sessions in turn needs: one's spinning
    threads steal the cores from the next).
    ``quiet``: onnxruntime logs nothing short of fatal (a probe whose run may fail, and says so by
    its result, not by an error line on the user's terminal).
    ``simulate_qdq``: a quantized (QDQ) model runs its QuantizeLinear/DequantizeLinear pairs as they are, in float,
    instead of onnxruntime's fused int8 kernels: the arithmetic of an int8 engine whose accumulators do not
    saturate (TensorRT's), where x86 CPUs without VNNI saturate 8-bit weights.
    ``prepack=False``: onnxruntime does not pre-pack the weights (a Gemm's matrix laid out for its kernel), for a
    session run a few times: packing costs more than it saves there (VGG-11's 530 MB: 0.56 -> 0.2 s to start a
    session run once; its runs no slower), and the outputs differ from a packing session's in the last bits.
    """
    if isinstance(model, onnx.ModelProto):
        light, weights = weights_aside(model)
        return session_of(light, weights, provider, threads, spinning, arena, spin_between_runs, quiet, prepack,
                          simulate_qdq)
    return session_of(model, {}, provider, threads, spinning, arena, spin_between_runs, quiet, prepack, simulate_qdq)


def session_of(model: ModelLike, weights: dict[str, np.ndarray], provider: str = "auto", threads: int | None = None,
               spinning: bool = True, arena: bool = True, spin_between_runs: bool = True, quiet: bool = False,
               prepack: bool = True, simulate_qdq: bool = False) -> tuple[ort.InferenceSession, str]:
    """``make_session``, the initializers ``weights`` (in-memory stubs in ``model``) given as arrays."""
    chain = _chain(provider)
    options = ort.SessionOptions()
    options.log_severity_level = 4 if quiet else 3
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if simulate_qdq:
        options.add_session_config_entry("session.disable_quant_qdq", "1")
    if threads is not None:
        options.intra_op_num_threads = threads
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif not spin_between_runs:
        options.add_session_config_entry("session.force_spinning_stop", "1")
    if not arena:
        options.enable_cpu_mem_arena = False
    if weights:  # the OrtValues only need to live until the session has copied them
        options.add_external_initializers(list(weights), [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
                                                          for a in weights.values()])
    if isinstance(model, onnx.ModelProto):
        source, name = model.SerializeToString(), "the in-memory model"
    elif isinstance(model, bytes):
        source, name = model, "the in-memory model"
    else:
        path = Path(model)
        if not path.is_file():
            raise ModelError(f"model file {path} not found: check the path")
        source, name = str(path), str(path)
    try:
        session = ort.InferenceSession(source, sess_options=options, providers=chain)
    except Exception as e:  # onnxruntime raises its own Exception subclasses (Fail, InvalidGraph, ...)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"onnxruntime cannot load {name} ({reason}): check it is a valid ONNX model") from e
    active = session.get_providers()[0]
    if active != chain[0] and provider != "auto":
        raise OnnxPruneError(
            f"{chain[0]} was requested but onnxruntime fell back to {active} (missing CUDA/cuDNN/TensorRT "
            "libraries?): fix the GPU install or use the cpu provider", option="provider"
        )
    return session, active


def _load_graph(model: onnx.ModelProto | str | Path) -> onnx.GraphProto:
    """The graph of ``model``, loading it (without external weights) if it is a path."""
    if isinstance(model, onnx.ModelProto):
        return model.graph
    path = Path(model)
    if not path.is_file():
        raise ModelError(f"model file {path} not found: check the path")
    try:
        return onnx.load(str(path), load_external_data=False).graph
    except (DecodeError, OSError, ValueError) as e:
        raise ModelError(f"{path} is not a readable ONNX model ({e}): re-export or re-download it") from e


def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    """Static dims as ints, symbolic ones as their name, unknown ones as None."""
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
        for d in value.type.tensor_type.shape.dim
    ]


def model_input_specs(model: onnx.ModelProto | str | Path) -> list[InputSpec]:
    """``(name, shape, numpy dtype)`` of each real graph input (initializers listed as inputs excluded)."""
    graph = _load_graph(model)
    weights = {init.name for init in graph.initializer}
    return [
        (v.name, _dims(v), np.dtype(onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)))
        for v in graph.input
        if v.name not in weights
    ]


def model_output_names(model: onnx.ModelProto | str | Path) -> list[str]:
    """The graph output names, in order."""
    return [v.name for v in _load_graph(model).output]


def run_session(session: ort.InferenceSession, feed: dict[str, np.ndarray], batch: int | None = None
                ) -> list[np.ndarray]:
    """All outputs of ``session`` on ``feed``, splitting/padding the batch if the model has a static batch
    size, or runs only at ``batch`` (a graph that writes its batch into its shapes)."""
    n = len(next(iter(feed.values())))
    size = session.get_inputs()[0].shape[0]
    size = size if isinstance(size, int) and size > 0 else batch
    if size is None or size == n:
        return session.run(None, feed)
    parts = []
    for start in range(0, n, size):
        chunk = {k: v[start : start + size] for k, v in feed.items()}
        m = len(next(iter(chunk.values())))
        chunk = {k: np.concatenate([v, np.repeat(v[-1:], size - m, axis=0)]) for k, v in chunk.items()}
        parts.append([y[:m] for y in session.run(None, chunk)])
    return [np.concatenate(zero_pad(*ys, first=1)) for ys in zip(*parts)]


def zero_pad(*arrays: np.ndarray, first: int = 0) -> list[np.ndarray]:
    """``arrays`` zero-padded at the end of each axis from ``first`` on to their common largest shape: outputs
    whose length varies from sample to sample (a decoded sequence) line up where all have entries, and an entry
    only some have counts against zeros in the others."""
    if len({a.shape[first:] for a in arrays}) <= 1:
        return list(arrays)
    if len({a.ndim for a in arrays}) > 1:
        raise ValueError(f"outputs of ranks {sorted({a.ndim for a in arrays})} cannot be lined up")
    shape = np.max([a.shape for a in arrays], axis=0)
    return [np.pad(a, [(0, 0)] * first + [(0, int(s - d)) for s, d in zip(shape[first:], a.shape[first:])])
            for a in arrays]


_ORT_PREFIX = re.compile(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ")
_ORT_NODE = re.compile(r"[Nn]ode(?:\. Name: ?| \(| name: |: ?)'?([^)',\s]+)")
_ORT_WHERE = re.compile(r"^(?:Non-zero status code returned while running \w+ node\. Name: ?'[^']*' Status Message: )?"
                        r"(?:[\w./-]+\.(?:h|cc|cpp):\d+ (?:[\w:]+ )?)?")


def ort_failure(exc: BaseException) -> tuple[str | None, str]:
    """The node onnxruntime names in its error ``exc`` (None where it names none) and its message in words: one
    line, without onnxruntime's status prefix and the source file it failed in."""
    text = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip()) or type(exc).__name__
    node = _ORT_NODE.search(text)
    words = _ORT_WHERE.sub("", _ORT_PREFIX.sub("", text), count=1).strip()
    return (node.group(1) if node else None), words or text
