"""Recurrent layers (LSTM, GRU, RNN): their input and hidden widths are kept, so the channels they read or write
stay; their weights are not pruned (the channel rule says so in words, for ``analyze``)."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Port, Role, Span


def _recurrent(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    side = "reads these channels as its input" if port[0] == "in" else "writes these channels"
    return Blocked(f"{node.op} {node.name} {side}: a recurrent layer keeps its widths (its weights are not pruned)")


for _op in ("LSTM", "GRU", "RNN"):
    register(OpEntry(_op, channels=_recurrent))
