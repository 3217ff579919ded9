"""The load rewrites (``normal.LOAD_REWRITES``) where ONNX shape inference cannot tell a tensor's shape: torch.onnx
writes ``chunk()`` at opset 13+ as a ``Slice`` whose bounds are computed from the input's ``Shape``, and inference
leaves every dim of its output unknown (EdgeNeXt's split attention: the branch fold read its channel count as an
int and crashed the load). Each rewrite's own model, every shape made unknown (rank kept, or not): the rewrites
leave what they cannot read and the model loads equal to the export; never an exception."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
import torch

from onnxprune.ir.graph import export_model
from onnxprune.ir.load import inferred_graph
from onnxprune.ir.rewrite import constants_read_directly
from onnxprune.normal import LOAD_REWRITES
from tests.onnx_builders import export_torch, run
from tests.test_attention import DIM, TOKENS, Attention
from tests.test_fold_branches import RepNet
from tests.test_layer_norm_written import SHAPE, WrittenNorm
from tests.test_real_exports_three import _keras_head
from tests.test_shuffle import ShuffleTiny


def _model(kind: str, tmp_path: Path) -> tuple[onnx.ModelProto, tuple[int, ...]]:
    """A model that each load rewrite rewrites, and its input shape."""
    torch.manual_seed(0)
    if kind == "nhwc_flatten":
        return _keras_head(), (2, 8, 8, 3)
    module, shape = {"branches": (RepNet, (1, 3, 16, 16)), "qkv": (Attention, (1, TOKENS, DIM)),
                     "shuffle": (ShuffleTiny, (1, 3, 16, 16)), "written_norm": (lambda: WrittenNorm(True), SHAPE)}[kind]
    return onnx.load(str(export_torch(module().eval(), tmp_path / f"{kind}.onnx", shape))), shape


def _unknown(graph: gs.Graph, keep_rank: bool) -> gs.Graph:
    """``graph`` with the shape of every tensor between its inputs and outputs unknown: each dim, or the rank too."""
    ends = {t.name for t in [*graph.inputs, *graph.outputs]}
    for tensor in graph.tensors().values():
        if isinstance(tensor, gs.Variable) and tensor.name not in ends:
            tensor.shape = [None] * len(tensor.shape) if keep_rank and tensor.shape is not None else None
    return graph


@pytest.mark.parametrize("keep_rank", [True, False])
@pytest.mark.parametrize("kind", ["branches", "qkv", "shuffle", "nhwc_flatten", "written_norm"])
def test_load_rewrites_leave_what_unknown_shapes_hide(kind: str, keep_rank: bool, tmp_path: Path) -> None:
    model, shape = _model(kind, tmp_path)
    graph = _unknown(constants_read_directly(inferred_graph(model)), keep_rank)
    for finds, rewrite in LOAD_REWRITES:
        if finds(graph):
            graph = rewrite(graph)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.testing.assert_allclose(run(export_model(graph), input=x)[0], run(model, input=x)[0], rtol=1e-5, atol=1e-5)
