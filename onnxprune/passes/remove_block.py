"""Pass: replace a residual block by its shortcut plus a constant (``analysis.blocks``)."""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.blocks import Block


def remove_block(graph: gs.Graph, block: Block, bias: np.ndarray) -> gs.Graph:
    """The block's residual Add reads the constant ``bias`` (one value per channel, broadcast over the
    positions) instead of its consumer's output; the consumer, its group's producer and the channel-wise ops
    between them, now unused, go with cleanup. The graph's inputs and outputs are unchanged.

    In place: ``graph`` is modified; returns the same graph, for chaining."""
    consumer = next(n for n in graph.nodes if n.name == block.consumer)
    y = consumer.outputs[0]
    add = next(n for n in y.outputs if n.name == block.add)
    dtype = y.dtype if y.dtype is not None else np.float32
    shape = [1, len(bias)] + [1] * (len(y.shape) - 2)
    constant = gs.Constant(f"{block.consumer}/removed_block_bias", np.asarray(bias, dtype=dtype).reshape(shape))
    add.inputs[add.inputs.index(y)] = constant
    consumer.outputs.clear()
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
