"""What a node does with a channel space reaching one of its ports: its op's channel rule in the
op registry (``onnxprune.ops``), answering one of the roles of ``onnxprune.ops.roles``."""

from __future__ import annotations

import onnx_graphsurgeon as gs

from onnxprune.ops.registry import lookup
from onnxprune.ops.roles import Blocked, Port, Role, Span


def role_of(node: gs.Node, port: Port, axis: int, repeat: int, span: Span = (0, 0)) -> Role:
    """What ``node`` does with a channel space reaching ``port`` at ``axis`` (``span`` on that axis)."""
    entry = lookup(node.op)
    if entry is None or entry.channels is None:
        return Blocked(f"op {node.op} ({node.name}) is not known to be channel-wise")
    return entry.channels(node, port, axis, repeat, span)
