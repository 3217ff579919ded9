"""onnxprune: channel pruning of ONNX CNNs without fine-tuning: greedy channel selection (group OMP by default,
the paper's local and global imitation as options) and a least-squares refit of the next layer.

The Python API (the CLI's flags build the same calls, through ``onnxprune.flags``)::

    import onnxprune
    from onnxprune.strategies import Ratio

    result = onnxprune.compress("model.onnx", "calib.npy", budget=Ratio(0.6))
    result.save("pruned.onnx")

    print(onnxprune.evaluate("pruned.onnx", "photos/", reference="model.onnx").top1)

``analyze``, ``compress``, ``recover`` and ``evaluate`` take a model path or an ``onnx.ModelProto``;
calibration data is what ``--calib`` accepts, or arrays; ``bench`` times models, ``export`` writes a
TensorRT-ready ONNX and engine. Image folders go
through one ``Preprocess`` (``preprocess_for(model)`` derives it from the model's input). The
strategies (budgets, selectors, allocators, reconstructions) are in ``onnxprune.strategies``; a subclass of
``Selector``, ``Allocator``, ``Reconstruction`` or ``Budget`` is a strategy of one's own. The
pruning loop itself is ``onnxprune.pipeline``; fidelity measures are ``onnxprune.evaluation``.
"""

from onnxprune.api import (
    Exported, Result, analyze, bench, calibration, compress, evaluate, export, load, preprocess_for, recover,
)
from onnxprune.calib.images import Preprocess
from onnxprune.deploy.bench import BenchResult
from onnxprune.errors import OnnxPruneError, OptionError
from onnxprune.evaluation import EvalResult
from onnxprune.recovery import Layout, Method, Mix, RecoverOptions, Train
from onnxprune.strategies import (
    L1, MACs, OMP, Allocator, Auto, Budget, Curve, Epsilon, Global, Latency, Local, NoRefit, Output, Random, Ratio,
    Reconstruction, Refit, Scale, Selector, Shared, Uniform,
)
from onnxprune.sweep import SweepResult, SweepRow, sweep

__version__ = "0.1.0"

__all__ = [
    "L1", "MACs", "OMP", "Allocator", "Auto", "BenchResult", "Budget", "Curve", "EvalResult", "Epsilon", "Exported", "Global", "Latency", "Local",
    "Layout", "Method", "Mix", "NoRefit", "OnnxPruneError", "OptionError", "Output", "Preprocess", "Random", "Ratio", "Reconstruction", "RecoverOptions",
    "Refit", "Result", "Scale", "Selector", "Shared", "SweepResult", "SweepRow", "Train", "Uniform", "analyze", "bench",
    "calibration", "compress", "evaluate", "export", "load", "preprocess_for", "recover", "sweep",
]
