"""A small ONNX -> torch evaluator: run an ONNX graph as a differentiable ``torch.nn.Module``.

Used where onnxruntime cannot help: gradients of the network's final discrepancy w.r.t. a
per-channel mask (global imitation) and training the pruned model's weights (few-shot recovery).

* The kernels live with the rest of each op's knowledge in ``onnxprune.ops`` (one module per op
  family), keyed by the opset each starts at; ``onnxprune.ops.kernel`` holds what they see (``OpNode``) and share.
* ``TorchGraph(model, outputs=..., inputs_at=..., hooks=...)`` (``engine``) evaluates the graph (or
  only the part downstream of ``inputs_at``); float initializers are ``nn.Parameter``s (shape-like
  floats and BatchNormalization statistics are buffers), ``Constant`` nodes are buffers.
* ``write_back(model, torch_graph)`` copies the (trained) tensors back into the initializers.

Semantics follow the ONNX spec as onnxruntime implements it, opsets 7-21 (where an attribute became an
input, a kernel per opset range, or one that reads either place).
"""

from onnxprune.runtime.torch_eval.engine import TorchGraph, write_back
from onnxprune.ops.kernel import OpNode, onnx_to_torch_dtype

__all__ = ["OpNode", "TorchGraph", "onnx_to_torch_dtype", "write_back"]
