"""What a model becomes on the way in (``load``: the load rewrites, which give the pruner channels it can follow), on
the way out (``written``: in ops its opset has), and before training (``untied``: one copy of a weight a reader)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx

from onnxprune.ir.inputs import specialise_inputs
from onnxprune.ir.load import load_model
from onnxprune.ir.rewrite import rewritten
from onnxprune.normal.flatten_channels_first import flatten_channels_first, has_channels_last_head
from onnxprune.normal.fold_branches import fold_branches, has_branches
from onnxprune.normal.fuse_layer_norm import fuse_layer_norm, has_written_layer_norm
from onnxprune.normal.split_qkv import has_fused_qkv, split_qkv
from onnxprune.normal.unshuffle import has_channel_permutation, unshuffle
from onnxprune.normal.untie_weights import has_shared_weights, untie_weights
from onnxprune.normal.write_layer_norm import OPSET, has_layer_norm_below_opset, write_layer_norm

LOAD_REWRITES = [(has_channels_last_head, flatten_channels_first), (has_branches, fold_branches),
                 (has_fused_qkv, split_qkv), (has_written_layer_norm, fuse_layer_norm),
                 (has_channel_permutation, unshuffle)]
WRITE_REWRITES = [(has_layer_norm_below_opset, write_layer_norm)]
UNTIE = [(has_shared_weights, untie_weights)]


def load(model: str | Path | onnx.ModelProto, input_shape: Sequence[str] | None = None) -> onnx.ModelProto:
    """``model`` (a path, read and checked, or a ModelProto) with its dynamic dims other than the batch fixed
    from ``input_shape`` (``["1x3x224x224"]`` or ``["name:1x3x320x320", ...]``, as ``--input-shape``), a
    channels-last flatten head read channels first (``flatten_channels_first``), and sums of convolution
    branches over one input folded into one convolution (``fold_branches``: RepVGG's and MobileOne's deploy
    form, the same function), an attention's fused q/k/v projection split into three (``split_qkv``, so
    that its heads prune), a LayerNorm written out as elementwise ops fused into one (``fuse_layer_norm``,
    so that its channels prune; below opset 17 a result writes it out again, see ``written``), and channel shuffles
    moved into the weights that read them (``unshuffle``, so that ShuffleNet's units prune)."""
    if isinstance(model, onnx.ModelProto):
        given = specialise_inputs(model, input_shape, model.graph.name or "the model")
    else:
        given = specialise_inputs(load_model(model), input_shape, str(model))
    return rewritten(given, LOAD_REWRITES, run=True)  # a dynamic export's shapes, for the passes' matchers


def written(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` in ops its opset has, as a result holds it and ``save`` writes it: a norm ``load`` fused into a
    ``LayerNormalization`` below opset 17 written out again (``write_layer_norm``)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), OPSET)
    if opset >= OPSET or not any(node.op_type == "LayerNormalization" for node in model.graph.node):
        return model  # no graph-surgeon round trip, no shape inference: most results
    return rewritten(model, WRITE_REWRITES, run=True)


def untied(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with a weight that several nodes read copied for each (``untie_weights``), so that training moves
    each copy on its own."""
    return rewritten(model, UNTIE)
