"""onnxprune: channel pruning of ONNX CNNs without fine-tuning: greedy channel selection (group OMP by default,
the paper's local and global imitation as options) and a least-squares refit of the next layer.

The Python API (the CLI's flags build the same calls, through ``onnxprune.flags``)::

    import onnxprune
    from onnxprune.strategies import Ratio

    result = onnxprune.compress("model.onnx", "calib.npy", budget=Ratio(0.6))
    result.save("pruned.onnx")

    print(onnxprune.evaluate("pruned.onnx", "photos/", reference="model.onnx").top1)

``analyze``, ``compress``, ``recover`` and ``evaluate`` take a model path or an ``onnx.ModelProto``;
calibration data is what ``--calib`` accepts, or arrays; ``quantize`` writes an INT8 (QDQ) model judged against
the original, ``bench`` times models, ``export`` writes a TensorRT-ready ONNX and engine. Image folders go
through one ``Preprocess`` (``preprocess_for(model)`` derives it from the model's input). The
strategies (budgets, selectors, allocators, reconstructions) are in ``onnxprune.strategies``; a subclass of
``Selector``, ``Allocator``, ``Reconstruction`` or ``Budget`` is a strategy of one's own. The
pruning loop itself is ``onnxprune.pipeline``; fidelity measures are ``onnxprune.deploy.evaluation``.
"""

import importlib

_HOMES = {
    "onnxprune.api": ["Exported", "Result", "analyze", "bench", "calibration", "compress", "evaluate", "export", "load",
                      "preprocess_for", "quantize", "recover"],
    "onnxprune.calib.images": ["Preprocess"],
    "onnxprune.deploy.bench": ["BenchResult"],
    "onnxprune.deploy.quantize": ["QuantizeOptions", "QuantizeReport"],
    "onnxprune.errors": ["OnnxPruneError", "OptionError"],
    "onnxprune.deploy.evaluation": ["EvalResult"],
    "onnxprune.recovery": ["Layout", "Method", "Mix", "RecoverOptions", "Train"],
    "onnxprune.strategies": ["L1", "MACs", "OMP", "Allocator", "Auto", "Budget", "Curve", "Epsilon", "Global", "Latency",
                             "Local", "NoRefit", "Output", "Random", "Ratio", "Reconstruction", "Recoverable", "Refit",
                             "Scale", "Selector", "Shared", "Uniform"],
    "onnxprune.sweep": ["SweepResult", "SweepRow", "sweep"],
    "onnxprune.torch": ["from_torch", "to_torch"],
}
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__version__ = "0.1.0"

__all__ = sorted(_HOME)


def __getattr__(name: str) -> object:
    """The API's names, imported on first use (torch and onnxruntime take a second and a half to import, and the
    command line restarts once before it needs them: ``runtime.hugepages``); a subpackage by its name."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name]), name)
    else:
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":  # a module it imports is missing: that is the error to see
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from e
    globals()[name] = value
    return value
