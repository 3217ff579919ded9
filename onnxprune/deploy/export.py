"""TensorRT deployment: a TensorRT-ready ONNX (static shapes, folded), trtexec line, engine build and timing."""

from __future__ import annotations

import importlib.util
import shlex
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx

from onnxprune.ir.graph import export_model
from onnxprune.ir.inputs import fix_input_shapes, resolve_input_shapes
from onnxprune.ir.load import load_model
from onnxprune.runtime.timing import random_inputs
from onnxprune.fileio import atomic_write
from onnxprune.errors import ModelError, OnnxPruneError, OutputError, UnsupportedOpError
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.shapes import onnx_infer
from onnxprune.deploy.quantize import quantized_nodes

# Standard-domain ops TensorRT 8.6+/10 parses (onnx-tensorrt operators.md), kept conservative: control
# flow (If/Loop/Scan), recurrent layers, NMS and data-dependent shapes (NonZero, Unique) are left out.
TENSORRT_OPS = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast Ceil Celu Clip
Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace DequantizeLinear Div Dropout
Einsum Elu Equal Erf Exp Expand Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool
GlobalMaxPool Greater GreaterOrEqual GroupNormalization HardSigmoid HardSwish Identity InstanceNormalization
LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax LRN MatMul Max MaxPool Mean Min Mish Mod Mul Neg
Not Or Pad Pow PRelu QuantizeLinear Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax
ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ScatterElements ScatterND Selu
Shape Sigmoid Sign Sin Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan
Tanh ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

ShapeArg = Mapping[str | None, Sequence[int]] | Iterable[str] | None


class TensorRTUnavailable(OnnxPruneError):
    """The ``tensorrt`` Python package (or a CUDA buffer library for timing) is not installed."""


def _fold(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant folding, graph clean-up and shape inference: onnxslim, else graph-surgeon + onnx (both leave a
    quantized model's Q/DQ pairs as they are)."""
    try:
        import onnxslim

        slimmed = onnxslim.slim(model)
        if isinstance(slimmed, onnx.ModelProto):
            model = slimmed
        else:
            raise RuntimeError("onnxslim returned no model")
    except Exception:  # onnxslim is best effort (it rejects some graphs); fall back to graph-surgeon
        import onnx_graphsurgeon as gs

        graph = gs.import_onnx(model)
        graph.fold_constants(error_ok=True).cleanup().toposort()
        model = export_model(graph)
    try:
        model = onnx_infer(model, data_prop=True)
    except Exception:  # onnx inference rejects a few valid graphs; onnxruntime fills the outputs below
        pass
    return model


def _fill_output_shapes(model: onnx.ModelProto, shapes: dict[str, list[int]]) -> None:
    """Give every graph output a static shape, running the model once on CPU where inference left gaps."""
    def static(v: onnx.ValueInfoProto) -> bool:
        t = v.type.tensor_type
        return t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim)

    if all(static(v) for v in model.graph.output):
        return
    from onnxprune.ir.ort import make_session

    session, _ = make_session(model, "cpu")
    outputs = session.run(None, random_inputs(model_input_specs(model), shapes))
    for value, array in zip(model.graph.output, outputs):
        dims = value.type.tensor_type.shape.dim
        del dims[:]
        for d in np.shape(array):
            dims.add().dim_value = int(d)


def unsupported_ops(model: onnx.ModelProto) -> Counter:
    """``{op_type: count}`` of the nodes outside the conservative TensorRT op list (or in another domain)."""
    return Counter(
        n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        for n in model.graph.node
        if n.domain not in ("", "ai.onnx") or n.op_type not in TENSORRT_OPS
    )


def prepare_for_tensorrt(model_path: str | Path, out_path: str | Path, input_shapes: ShapeArg = None) -> Path:
    """Write a TensorRT-ready copy of ``model_path`` to ``out_path`` and return ``out_path``.

    Every input gets a static shape (a dynamic batch dim defaults to 1, other dynamic dims come from
    ``input_shapes``), constants are folded and shapes re-inferred, the result passes onnx.checker and
    holds only ops TensorRT parses. Written atomically; never over the input.
    """
    model_path, out_path = Path(model_path), Path(out_path)
    if model_path.exists() and out_path.resolve() == model_path.resolve():
        raise OutputError(f"{out_path}: the output would overwrite the input: choose another output path")
    model = load_model(model_path)
    specs = model_input_specs(model)
    shapes = resolve_input_shapes(specs, input_shapes, None, str(model_path))
    model = _fold(fix_input_shapes(model, shapes))
    _fill_output_shapes(model, shapes)

    bad = unsupported_ops(model)
    if bad:
        ops = ", ".join(f"{op} (x{n})" for op, n in sorted(bad.items()))
        raise UnsupportedOpError(f"{model_path}: ops TensorRT may not support remain after folding: {ops}: "
                                 "replace them in the exported model (or build with trtexec and check its log)")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ModelError(f"{model_path}: the TensorRT-ready model fails onnx.checker ({first}): "
                         "report this with the model") from exc

    return atomic_write(out_path, lambda tmp: onnx.save(model, str(tmp)), refuse=[model_path])


def _shape_text(shapes: Mapping[str, Sequence[int]]) -> str:
    return ",".join(f"{name}:{'x'.join(str(int(d)) for d in dims)}" for name, dims in shapes.items())


def trtexec_command(
    onnx_path: str | Path,
    engine_path: str | Path,
    fp16: bool = False,
    workspace_mb: int = 1024,
    shapes: Mapping[str, Sequence[int]] | None = None,
    int8: bool = False,
) -> str:
    """The equivalent ``trtexec`` command line (``--shapes`` sets min = opt = max for dynamic inputs; ``int8``: the
    model is quantized, its Q/DQ pairs run in INT8)."""
    parts = ["trtexec", f"--onnx={shlex.quote(str(onnx_path))}", f"--saveEngine={shlex.quote(str(engine_path))}"]
    if fp16:
        parts.append("--fp16")
    if int8:
        parts.append("--int8")
    parts.append(f"--memPoolSize=workspace:{int(workspace_mb)}M")
    if shapes:
        parts.append(f"--shapes={shlex.quote(_shape_text(shapes))}")
    return " ".join(parts)


def _dynamic_shapes(onnx_path: Path, shapes: ShapeArg) -> dict[str, list[int]]:
    """Resolved shapes of the inputs that have a dynamic dim (the only ones TensorRT needs a profile for)."""
    specs = model_input_specs(onnx_path)
    resolved = resolve_input_shapes(specs, shapes, None, str(onnx_path))
    return {
        name: resolved[name]
        for name, dims, _ in specs
        if any(not (isinstance(d, int) and d > 0) for d in dims)
    }


def have_tensorrt() -> bool:
    """Whether the ``tensorrt`` Python package is installed."""
    return importlib.util.find_spec("tensorrt") is not None


def _import_tensorrt(onnx_path: Path, engine_path: Path, fp16: bool, workspace_mb: int, shapes: dict, int8: bool):
    try:
        import tensorrt as trt
    except ImportError as exc:
        cmd = trtexec_command(onnx_path, engine_path, fp16, workspace_mb, shapes, int8)
        raise TensorRTUnavailable(
            f"TensorRT is not installed (pip install onnxprune[tensorrt]); the TensorRT-ready ONNX is {onnx_path}: "
            f"build the engine on a machine with TensorRT with: {cmd}"
        ) from exc
    return trt


def build_engine(
    onnx_path: str | Path,
    engine_path: str | Path,
    *,
    fp16: bool = False,
    workspace_mb: int = 1024,
    shapes: ShapeArg = None,
) -> Path:
    """Build a serialized TensorRT engine from ``onnx_path`` (TensorRT 10 API) and write it atomically.

    Inputs with dynamic dims get an optimisation profile with min = opt = max = their resolved shape
    (batch 1 unless ``shapes`` says otherwise). A quantized model (Q/DQ pairs, as ``quantize`` writes them) is
    built with INT8 kernels allowed (explicit quantization).
    """
    onnx_path, engine_path = Path(onnx_path), Path(engine_path)
    if not onnx_path.is_file():
        raise ModelError(f"{onnx_path}: no such file: check the path (make it with prepare_for_tensorrt)")
    if workspace_mb < 1:
        raise OnnxPruneError(f"workspace of {workspace_mb} MB is invalid: use at least 1 MB")
    dynamic = _dynamic_shapes(onnx_path, shapes)
    int8 = bool(quantized_nodes(onnx.load(str(onnx_path), load_external_data=False)))
    trt = _import_tensorrt(onnx_path, engine_path, fp16, workspace_mb, dynamic, int8)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(min(parser.num_errors, 3)))
        raise ModelError(f"{onnx_path}: TensorRT cannot parse the model ({errors}): run prepare_for_tensorrt "
                         "first, or check the op against TensorRT's ONNX operator list")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_mb) << 20)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if int8:
        config.set_flag(trt.BuilderFlag.INT8)
    if dynamic:
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            tensor = network.get_input(i)
            if tensor.name in dynamic:
                shape = tuple(dynamic[tensor.name])
                profile.set_shape(tensor.name, shape, shape, shape)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise OnnxPruneError(f"{onnx_path}: TensorRT failed to build an engine (see its log above): try a "
                             f"larger workspace, or run: "
                             f"{trtexec_command(onnx_path, engine_path, fp16, workspace_mb, dynamic, int8)}")

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(memoryview(serialized))

    return atomic_write(engine_path, write, refuse=[onnx_path])


class _TorchBuffers:
    """Device buffers and a stream from torch.cuda."""

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch has no CUDA")
        self.torch = torch
        self.stream = torch.cuda.Stream()
        self.handle = self.stream.cuda_stream
        self.keep: list = []

    def alloc(self, array: np.ndarray) -> int:
        tensor = self.torch.from_numpy(np.ascontiguousarray(array)).to("cuda")
        self.torch.cuda.synchronize()  # the copy ran on torch's default stream, the engine uses self.stream
        self.keep.append(tensor)
        return tensor.data_ptr()

    def sync(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        self.keep.clear()


class _CudaPythonBuffers:
    """Device buffers and a stream from cuda-python's runtime bindings."""

    def __init__(self) -> None:
        try:
            from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
        except ImportError:
            from cuda import cudart  # older cuda-python
        self.cudart = cudart
        self.handle = self._ok(cudart.cudaStreamCreate())
        self.ptrs: list[int] = []

    def _ok(self, result):
        err, *rest = result
        if int(err) != 0:
            raise OnnxPruneError(f"CUDA call failed ({err}): check the GPU driver and that a GPU is visible")
        return rest[0] if rest else None

    def alloc(self, array: np.ndarray) -> int:
        array = np.ascontiguousarray(array)
        ptr = self._ok(self.cudart.cudaMalloc(max(array.nbytes, 1)))
        self.ptrs.append(ptr)
        self._ok(self.cudart.cudaMemcpy(ptr, array.ctypes.data, array.nbytes,
                                        self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice))
        return int(ptr)

    def sync(self) -> None:
        self._ok(self.cudart.cudaStreamSynchronize(self.handle))

    def close(self) -> None:
        for ptr in self.ptrs:
            self.cudart.cudaFree(ptr)
        self.ptrs.clear()
        self.cudart.cudaStreamDestroy(self.handle)


def _buffers():
    for kind in (_TorchBuffers, _CudaPythonBuffers):
        try:
            return kind()
        except ImportError:
            continue
    raise TensorRTUnavailable("timing a TensorRT engine needs CUDA buffers: install torch with CUDA or "
                              "cuda-python (pip install cuda-python)")


def engine_latency(engine_path: str | Path, *, runs: int = 100, warmup: int = 10) -> dict:
    """Median/p90/p99/mean latency (ms) and throughput of a serialized engine with TensorRT's runtime.

    Dynamic inputs take the optimisation profile's opt shape; inputs are random. Timed with
    ``time.perf_counter`` around ``execute_async_v3`` + stream synchronisation.
    """
    engine_path = Path(engine_path)
    if not engine_path.is_file():
        raise ModelError(f"{engine_path}: no such engine file: build it with build_engine first")
    try:
        import tensorrt as trt
    except ImportError as exc:
        raise TensorRTUnavailable("TensorRT is not installed (pip install onnxprune[tensorrt]): "
                                  f"cannot time {engine_path}") from exc
    if runs < 1 or warmup < 0:
        raise OnnxPruneError(f"runs {runs} / warmup {warmup} are invalid: use runs >= 1 and warmup >= 0")

    logger = trt.Logger(trt.Logger.WARNING)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
    if engine is None:
        raise ModelError(f"{engine_path}: TensorRT cannot load the engine (built by another TensorRT version "
                         "or GPU?): rebuild it on this machine")
    context = engine.create_execution_context()
    rng = np.random.default_rng(0)
    buffers = _buffers()
    batch = None
    try:
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        for name in inputs:
            shape = tuple(engine.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                shape = tuple(engine.get_tensor_profile_shape(name, 0)[1])  # (min, opt, max)
                context.set_input_shape(name, shape)
            if batch is None and shape:
                batch = int(shape[0])
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            data = (rng.standard_normal(shape).astype(dtype) if np.issubdtype(dtype, np.floating)
                    else np.zeros(shape, dtype))
            context.set_tensor_address(name, buffers.alloc(data))
        for name in names:
            if name in inputs:
                continue
            shape = tuple(context.get_tensor_shape(name))
            dtype = np.dtype(trt.nptype(engine.get_tensor_dtype(name)))
            context.set_tensor_address(name, buffers.alloc(np.zeros(shape, dtype)))

        def run() -> None:
            if not context.execute_async_v3(buffers.handle):
                raise OnnxPruneError(f"{engine_path}: TensorRT failed to execute the engine (see its log)")
            buffers.sync()

        for _ in range(warmup):
            run()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    finally:
        buffers.close()

    ms = np.asarray(times) * 1e3
    batch = batch or 1
    return {
        "engine": str(engine_path),
        "provider": "TensorRT",
        "batch": batch,
        "median_ms": float(np.median(ms)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "throughput": float(batch * len(times) / sum(times)) if sum(times) > 0 else float("inf"),
        "runs": len(times),
    }
