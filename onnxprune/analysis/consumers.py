"""How each channel-mixing consumer op reads its input as a matrix, keyed by ONNX ``op_type``.

Every consumer is seen as ``t = W x + b`` over "positions": ``x`` is a column of the unfolded
input (D = channels × K entries, channel-major, K = kernel taps or flattened spatial size), ``W``
is (O, D). ``unfold`` gives (B, D, positions) in torch; ``matrix``/``write`` convert to and from
the op's own weight layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs
import torch
import torch.nn.functional as F

from onnxprune.analysis.graph import const_value, static_shape
from onnxprune.analysis.groups import ConsumerUse, Group
from onnxprune.errors import UnsupportedOpError


@dataclass
class Linear:
    """A consumer as a matrix: W (O, D), b (O), K columns per input channel."""

    weight: np.ndarray
    bias: np.ndarray
    k: int


def _conv_pads(node: gs.Node) -> list[int]:
    """ONNX pads [b1, b2, e1, e2] of a 2-D Conv, resolving auto_pad from the shapes."""
    kernel = list(node.inputs[1].shape[2:])
    auto = node.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto, bytes):
        auto = auto.decode()
    if auto in ("NOTSET", ""):
        return list(node.attrs.get("pads", [0] * 2 * len(kernel)))
    if auto == "VALID":
        return [0] * 2 * len(kernel)
    strides = node.attrs.get("strides", [1] * len(kernel))
    dil = node.attrs.get("dilations", [1] * len(kernel))
    in_shape = static_shape(node.inputs[0])[2:]
    begin, end = [], []
    for size, k, s, d in zip(in_shape, kernel, strides, dil):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        begin.append(large if auto == "SAME_LOWER" else small)
        end.append(small if auto == "SAME_LOWER" else large)
    return begin + end


def conv_unfold(node: gs.Node, x: torch.Tensor) -> torch.Tensor:
    """im2col patches (B, C·kh·kw, L) of a 2-D Conv's input (a free view for an unpadded 1×1)."""
    w_shape = node.inputs[1].shape
    if len(w_shape) == 3:  # 1-D: a 2-D conv over a height of 1
        (begin, end), k = _conv_pads(node), w_shape[2]
        return F.unfold(F.pad(x, (begin, end)).unsqueeze(2), kernel_size=(1, k),
                        dilation=(1, node.attrs.get("dilations", [1])[0]), stride=(1, node.attrs.get("strides", [1])[0]))
    if len(w_shape) != 4:
        raise UnsupportedOpError(f"Conv {node.name}: only 1-D and 2-D convolutions can be re-fitted")
    pads = _conv_pads(node)
    strides = tuple(node.attrs.get("strides", [1, 1]))
    if tuple(w_shape[2:]) == (1, 1) and not any(pads):
        return x[:, :, :: strides[0], :: strides[1]].flatten(2)
    x = F.pad(x, (pads[1], pads[3], pads[0], pads[2]))
    return F.unfold(
        x,
        kernel_size=tuple(w_shape[2:]),
        dilation=tuple(node.attrs.get("dilations", [1, 1])),
        stride=strides,
    )


def conv_transpose_unfold(node: gs.Node, x: torch.Tensor) -> torch.Tensor:
    """A 2-D ConvTranspose is a stride-1 Conv with the flipped kernel on the input with ``stride - 1``
    zeros between pixels, padded by ``dilation·(k-1) - pads`` (+ output_padding at the end): its patches."""
    kh, kw = node.inputs[1].shape[2:]
    sh, sw = node.attrs.get("strides", [1, 1])
    dh, dw = node.attrs.get("dilations", [1, 1])
    top, left, bottom, right = node.attrs.get("pads", [0, 0, 0, 0])
    oph, opw = node.attrs.get("output_padding", [0, 0])
    b, c, h, w = x.shape
    up = x.new_zeros(b, c, (h - 1) * sh + 1, (w - 1) * sw + 1)
    up[:, :, ::sh, ::sw] = x
    up = F.pad(up, (dw * (kw - 1) - left, dw * (kw - 1) - right + opw, dh * (kh - 1) - top, dh * (kh - 1) - bottom + oph))
    return F.unfold(up, kernel_size=(kh, kw), dilation=(dh, dw))


def matrix(node: gs.Node) -> Linear:
    """The consumer's weights as (O, D) plus bias."""
    w = const_value(node.inputs[1]).astype(np.float64)
    if node.op == "ConvTranspose":  # (C, O, kh, kw) -> the equivalent Conv's flipped (O, C, kh, kw)
        bias = const_value(node.inputs[2]) if len(node.inputs) > 2 else np.zeros(w.shape[1])
        conv = np.ascontiguousarray(w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3))
        return Linear(conv.reshape(conv.shape[0], -1), bias.astype(np.float64), int(np.prod(w.shape[2:])))
    if node.op == "Conv":
        bias = const_value(node.inputs[2]) if len(node.inputs) > 2 else np.zeros(w.shape[0])
        return Linear(w.reshape(w.shape[0], -1), bias.astype(np.float64), int(np.prod(w.shape[2:])))
    if node.op == "Gemm":
        alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
        w = alpha * (w if int(node.attrs.get("transB", 0)) else w.T)
        bias = np.zeros(w.shape[0])
        if len(node.inputs) > 2:
            bias = bias + beta * const_value(node.inputs[2]).astype(np.float64).reshape(-1)
        return Linear(w, bias, 1)
    if node.op == "MatMul":
        add = bias_add(node)
        bias = np.zeros(w.shape[1]) if add is None else const_value(add.inputs[1]).astype(np.float64)
        return Linear(w.T, bias, 1)
    raise UnsupportedOpError(f"{node.op} {node.name}: not a supported consumer")


def unfold(node: gs.Node, x: torch.Tensor) -> torch.Tensor:
    """What the consumer multiplies by W, channel-major: (B, D, positions)."""
    if node.op == "Conv":
        return conv_unfold(node, x)
    if node.op == "ConvTranspose":
        return conv_transpose_unfold(node, x)
    return columns(node, x)


def columns(node: gs.Node, y: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like the consumer's output (or a Gemm/MatMul input) as (B, channels, positions),
    with positions in the order ``unfold`` uses."""
    if node.op in ("Conv", "ConvTranspose"):
        return y.flatten(2)
    return y.reshape(-1, y.shape[-1]).T.unsqueeze(0)


def bias_add(node: gs.Node) -> gs.Node | None:
    """The bias ``Add`` that ``write`` put after a MatMul consumer (a MatMul has no bias input), if any."""
    out = node.outputs[0]
    if node.op != "MatMul" or len(out.outputs) != 1:
        return None
    add = out.outputs[0]
    if add.op != "Add" or add.name != f"{node.name}.bias_add" or add.inputs[0] is not out:
        return None
    return add


def write(graph: gs.Graph, node: gs.Node, linear: Linear) -> None:
    """Store ``linear`` as the node's weights (in its own layout), adding a bias where needed."""
    dtype = np.asarray(node.inputs[1].values).dtype
    w, b = linear.weight.astype(dtype), linear.bias.astype(dtype)
    name = node.name
    if node.op in ("Conv", "ConvTranspose", "Gemm"):
        if node.op == "Conv":
            old = node.inputs[1].shape
            node.inputs[1] = gs.Constant(f"{name}.weight", w.reshape(old[0], -1, *old[2:]))
        elif node.op == "ConvTranspose":
            old = node.inputs[1].shape
            conv = w.reshape(old[1], -1, *old[2:])[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
            node.inputs[1] = gs.Constant(f"{name}.weight", np.ascontiguousarray(conv))
        else:
            trans_b = int(node.attrs.get("transB", 0))
            node.inputs[1] = gs.Constant(f"{name}.weight", w if trans_b else np.ascontiguousarray(w.T))
            node.attrs["alpha"], node.attrs["beta"] = 1.0, 1.0
        bias = gs.Constant(f"{name}.bias", b)
        if len(node.inputs) > 2:
            node.inputs[2] = bias
        else:
            node.inputs.append(bias)
    elif node.op == "MatMul":
        node.inputs[1] = gs.Constant(f"{name}.weight", np.ascontiguousarray(w.T))
        add = bias_add(node)
        if add is not None:  # written before: update that bias rather than stacking a second Add
            add.inputs[1] = gs.Constant(f"{name}.bias", b)
        elif np.any(b != 0):
            out = node.outputs[0]
            # no shape: it would go stale when a later group slices this MatMul's output channels
            mid = gs.Variable(f"{name}.matmul_out", dtype=out.dtype)
            node.outputs[0] = mid
            graph.nodes.append(gs.Node("Add", f"{name}.bias_add", inputs=[mid, gs.Constant(f"{name}.bias", b)],
                                       outputs=[out]))
    else:
        raise UnsupportedOpError(f"{node.op} {name}: not a supported consumer")


@dataclass
class ColumnView:
    """A group's columns in one consumer's (O, D) matrix: ``cols`` channel-major (``k`` per group
    channel: kernel taps × entries per channel × the ranges it fills), ``rest`` the other groups' columns."""

    cols: np.ndarray
    rest: np.ndarray
    k: int

    def __post_init__(self) -> None:
        self.whole = not self.rest.size and bool(np.all(self.cols == np.arange(self.cols.size)))

    def linear(self, full: Linear) -> Linear:
        return Linear(full.weight if self.whole else full.weight[:, self.cols], full.bias, self.k)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The group's rows of an unfolded input (B, D, positions)."""
        return x if self.whole else x[:, torch.from_numpy(self.cols)]


def group_view(graph: gs.Graph, node: gs.Node, group: Group, use: ConsumerUse) -> ColumnView:
    """Where ``group``'s channels sit among the consumer's columns in ``graph`` (pruned or original)."""
    full = matrix(node)
    taps = full.k if node.op in ("Conv", "ConvTranspose") else 1
    tensors = graph.tensors()
    width = group.width(tensors)
    entries = np.stack([group.entries(tensors, use.tensor, o, use.repeat) for o in group.offsets[use.tensor]])
    # (ranges, width·repeat) entries -> (width, ranges·repeat·taps) columns, channel-major
    entries = entries.reshape(len(entries), width, use.repeat).transpose(1, 0, 2).reshape(width, -1)
    cols = (entries[:, :, None] * taps + np.arange(taps)).reshape(-1)
    return ColumnView(cols, np.setdiff1d(np.arange(full.weight.shape[1]), cols), cols.size // max(width, 1))
