"""Control flow (Loop, If, Scan): the tool prunes around these nodes and leaves their subgraphs as they are.

Channels that reach one, as an input or read from inside a body (``analysis.groups``), keep their width.
Their bodies' MACs are not counted (``analysis.macs.uncounted``)."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Port, Role, Span


def _control(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    return Blocked(f"{node.op} {node.name} is control flow: its subgraph is left as it is")


for _op in ("Loop", "If", "Scan"):
    register(OpEntry(_op, channels=_control))
