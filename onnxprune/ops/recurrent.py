"""Recurrent layers (LSTM, GRU, RNN): their input and hidden widths are kept, so the channels they read or write
stay; their weights are not pruned (the channel rule says so in words, for ``analyze``). Their torch kernel runs them
as ONNX defines them, so that ``recover`` and ``to_torch`` train the rest of a recurrent model."""

from __future__ import annotations

from collections.abc import Callable

import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.ops.kernel import Inputs, OpNode, Tensor
from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Port, Role, Span


def _recurrent(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    side = "reads these channels as its input" if port[0] == "in" else "writes these channels"
    return Blocked(f"{node.op} {node.name} {side}: a recurrent layer keeps its widths (its weights are not pruned)")




_ACTIVATIONS = {"sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu}  # by lower-case name
_DEFAULTS = {"LSTM": ("Sigmoid", "Tanh", "Tanh"), "GRU": ("Sigmoid", "Tanh"), "RNN": ("Tanh",)}


def _check(node: OpNode, proto: onnx.NodeProto) -> str | None:
    """Why the torch kernel cannot run ``node``: an activation other than Sigmoid, Tanh and Relu, coupled gates, or
    the batch-first layout."""
    other = sorted({a for a in node.get("activations", []) if a.lower() not in _ACTIVATIONS})
    if other:
        return f"activations {', '.join(other)}"
    if node.get("input_forget", 0):
        return "input_forget=1"
    if node.get("layout", 0):
        return "layout=1 (batch first), which onnxruntime does not run either"
    return None


def _cell(op: str, acts: list[Callable[[Tensor], Tensor]], clip: float | None, hidden: int, extra: dict
          ) -> Callable[[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor | None]]:
    """One step of ``op`` for one direction: (x·Wᵀ + Wb, h, c, R, Rb, P) -> (h, c); ONNX's equations and gate
    orders (LSTM iofc, GRU zrh)."""
    def gate(v: Tensor, k: int) -> Tensor:
        return acts[k](v if clip is None else v.clamp(-clip, clip))

    def lstm(xw: Tensor, h: Tensor, c: Tensor | None, r: Tensor, rb: Tensor, p: Tensor | None
             ) -> tuple[Tensor, Tensor | None]:
        i, o, f, g = (xw + h @ r.T + rb).split(hidden, dim=-1)
        pi, po, pf = (None, None, None) if p is None else p.split(hidden)
        i = gate(i if pi is None else i + pi * c, 0)
        f = gate(f if pf is None else f + pf * c, 0)
        c = f * c + i * gate(g, 1)
        o = gate(o if po is None else o + po * c, 0)
        return o * acts[2](c), c

    def gru(xw: Tensor, h: Tensor, c: Tensor | None, r: Tensor, rb: Tensor, p: Tensor | None
            ) -> tuple[Tensor, Tensor | None]:
        xz, xr, xh = xw.split(hidden, dim=-1)
        rz, rr, rh = r.split(hidden)
        bz, br, bh = rb.split(hidden)
        z, reset = gate(xz + h @ rz.T + bz, 0), gate(xr + h @ rr.T + br, 0)
        if extra["linear_before_reset"]:
            candidate = gate(xh + reset * (h @ rh.T + bh), 1)
        else:
            candidate = gate(xh + (reset * h) @ rh.T + bh, 1)
        return (1 - z) * candidate + z * h, None

    def rnn(xw: Tensor, h: Tensor, c: Tensor | None, r: Tensor, rb: Tensor, p: Tensor | None
            ) -> tuple[Tensor, Tensor | None]:
        return gate(xw + h @ r.T + rb, 0), None

    return {"LSTM": lstm, "GRU": gru, "RNN": rnn}[op]


def _recurrent_kernel(node: OpNode, inputs: Inputs) -> list[Tensor]:
    """LSTM, GRU and RNN as ONNX defines them (any direction, clip, peepholes, sequence lengths; the sequence first):
    Y, Y_h and (LSTM) Y_c."""
    op, x, w, r = node.op_type, *inputs[:3]
    b, lengths, h0 = (inputs[i] if len(inputs) > i else None for i in (3, 4, 5))
    c0, peep = (inputs[i] if len(inputs) > i else None for i in (6, 7)) if op == "LSTM" else (None, None)
    hidden = node.get("hidden_size", r.shape[-1])
    steps, batch = x.shape[:2]
    dirs = w.shape[0]
    names = node.get("activations") or list(_DEFAULTS[op]) * dirs
    per = len(_DEFAULTS[op])
    gates = r.shape[1]
    b = w.new_zeros(dirs, 2 * gates) if b is None else b
    lengths = None if lengths is None else lengths.to(torch.long)
    reverse = {"reverse": [True], "bidirectional": [False, True]}.get(node.get("direction", "forward"), [False])
    ys, hs, cs = [], [], []
    for d, back in enumerate(reverse):
        acts = [_ACTIVATIONS[a.lower()] for a in names[d * per:(d + 1) * per]]
        cell = _cell(op, acts, node.get("clip"), hidden, {"linear_before_reset": node.get("linear_before_reset", 0)})
        xw = x @ w[d].T + b[d, :gates]
        h = x.new_zeros(batch, hidden) if h0 is None else h0[d]
        c = (x.new_zeros(batch, hidden) if c0 is None else c0[d]) if op == "LSTM" else None
        out = [x.new_zeros(batch, hidden)] * steps
        for t in (range(steps - 1, -1, -1) if back else range(steps)):
            h_new, c_new = cell(xw[t], h, c, r[d], b[d, gates:], None if peep is None else peep[d])
            if lengths is not None:  # past a sample's length its state stays and its output is zero
                live = (t < lengths)[:, None]
                h_new = torch.where(live, h_new, h)
                c_new = None if c is None else torch.where(live, c_new, c)
                out[t] = torch.where(live, h_new, torch.zeros_like(h_new))
            else:
                out[t] = h_new
            h, c = h_new, c_new
        ys.append(torch.stack(out))
        hs.append(h)
        cs.append(c)
    results = [torch.stack(ys, dim=1), torch.stack(hs)]  # [seq, dirs, batch, hidden], [dirs, batch, hidden]
    if op == "LSTM":
        results.append(torch.stack(cs))
    return results[:node.num_outputs]


for _op in ("LSTM", "GRU", "RNN"):
    register(OpEntry(_op, channels=_recurrent, torch={7: _recurrent_kernel}, static_inputs=frozenset({4}),
                     check=_check))
