"""Resize and Upsample: the channel rule, torch kernels (onnxruntime's float32 coordinates)."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.ir.graph import static_shape
from onnxprune.errors import UnsupportedOpError
from onnxprune.ops.registry import OpEntry, register
from onnxprune.ops.roles import Blocked, Channelwise, Port, Role, Span
from onnxprune.ops.kernel import Inputs, OpNode, Tensor, axis_of, floats, given, ints


def _resize_rule(node: gs.Node, port: Port, axis: int, repeat: int, span: Span) -> Role:
    if port not in (("in", 0), ("out", 0)):
        return Blocked(f"{node.op} {node.name}: channels reach a parameter input")
    i_shape, o_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
    if not i_shape or not o_shape or i_shape[axis] != o_shape[axis]:
        return Blocked(f"{node.op} {node.name}: may resize the channel axis")
    return Channelwise({("in", 0): (axis, repeat), ("out", 0): (axis, repeat)})


def _source_coords(mode: str, out_len: int, in_len: int, scale: np.float32, roi: tuple[float, float]) -> np.ndarray:
    """Source coordinate of every output index, in float32 like onnxruntime."""
    f = np.float32
    xr = np.arange(out_len, dtype=f)
    s = f(scale)
    if mode == "half_pixel":
        return (xr + f(0.5)) / s - f(0.5)
    if mode == "half_pixel_symmetric":
        adj = f(out_len) / (f(in_len) * s)
        offset = f(in_len) / f(2) * (f(1) - adj)
        return offset + (xr + f(0.5)) / s - f(0.5)
    if mode == "pytorch_half_pixel":
        return (xr + f(0.5)) / s - f(0.5) if out_len > 1 else np.zeros(out_len, f)
    if mode == "align_corners":
        return xr * f(in_len - 1) / f(out_len - 1) if out_len > 1 else np.zeros(out_len, f)
    if mode == "asymmetric":
        return xr / s
    if mode == "tf_crop_and_resize":
        start, end = f(roi[0]), f(roi[1])
        if out_len > 1:
            return start * f(in_len - 1) + xr * (end - start) * f(in_len - 1) / f(out_len - 1)
        return np.full(out_len, f(0.5) * (start + end) * f(in_len - 1), f)
    raise UnsupportedOpError(f"Resize coordinate_transformation_mode {mode!r} is not supported")


def _nearest(xo: np.ndarray, mode: str, scale: float) -> np.ndarray:
    if mode == "round_prefer_floor":
        return np.where(xo == np.trunc(xo) + np.float32(0.5), np.floor(xo), np.sign(xo) * np.floor(np.abs(xo) + 0.5))
    if mode == "round_prefer_ceil":
        return np.sign(xo) * np.floor(np.abs(xo) + 0.5)
    if mode == "floor":
        return np.floor(xo)
    if mode == "ceil":
        return np.ceil(xo)
    if mode == "simple":  # Upsample / Resize-10
        return np.ceil(xo) if scale < 1 else np.trunc(xo)
    raise UnsupportedOpError(f"Resize nearest_mode {mode!r} is not supported")


def _cubic_coeffs(t: np.ndarray, a: float, dtype=np.float32) -> np.ndarray:
    a = dtype(a)
    one = dtype(1)
    s = [t + one, t, one - t, dtype(2) - t]
    c0 = ((a * s[0] - 5 * a) * s[0] + 8 * a) * s[0] - 4 * a
    c1 = ((a + 2) * s[1] - (a + 3)) * s[1] * s[1] + one
    c2 = ((a + 2) * s[2] - (a + 3)) * s[2] * s[2] + one
    c3 = ((a * s[3] - 5 * a) * s[3] + 8 * a) * s[3] - 4 * a
    return np.stack([c0, c1, c2, c3], -1)


def _resize_axis(t: Tensor, axis: int, out_len: int, scale: float, roi, node: OpNode, mode: str, legacy: bool):
    """Resize ``t`` along one axis; returns the tensor and an extrapolation mask (or None)."""
    in_len = t.shape[axis]
    ctm = "asymmetric" if legacy else node.get("coordinate_transformation_mode", "half_pixel")
    xo = _source_coords(ctm, out_len, in_len, np.float32(scale), roi)
    dev = t.device
    outside = None
    if ctm == "tf_crop_and_resize":
        bad = (xo < 0) | (xo > in_len - 1)
        if bad.any():
            outside = torch.from_numpy(bad).to(dev)
    view = [1] * t.dim()
    view[axis] = out_len
    if mode == "nearest":
        nmode = "simple" if legacy else node.get("nearest_mode", "round_prefer_floor")
        idx = np.clip(_nearest(xo, nmode, scale), 0, in_len - 1).astype(np.int64)
        return t.index_select(axis, torch.from_numpy(idx).to(dev)), outside
    if mode == "linear":
        xc = np.clip(xo, 0, in_len - 1)
        lo = np.floor(xc).astype(np.int64)
        hi = np.minimum(lo + 1, in_len - 1)
        w = torch.from_numpy((xc - lo).astype(np.float32)).to(device=dev, dtype=t.dtype).reshape(view)
        a = t.index_select(axis, torch.from_numpy(lo).to(dev))
        b = t.index_select(axis, torch.from_numpy(hi).to(dev))
        return a + (b - a) * w, outside
    if mode == "cubic":
        base = np.floor(xo).astype(np.int64)
        coeffs = _cubic_coeffs((xo - base).astype(np.float32), node.get("cubic_coeff_a", -0.75))
        taps = base[:, None] + np.arange(-1, 3)[None, :]
        if node.get("exclude_outside", 0):
            inside = (taps >= 0) & (taps < in_len)
            coeffs = coeffs * inside
            coeffs = coeffs / coeffs.sum(-1, keepdims=True)
        taps = np.clip(taps, 0, in_len - 1)
        out = None
        for j in range(4):
            w = torch.from_numpy(coeffs[:, j].astype(np.float32)).to(device=dev, dtype=t.dtype).reshape(view)
            part = t.index_select(axis, torch.from_numpy(taps[:, j]).to(dev)) * w
            out = part if out is None else out + part
        return out, outside
    raise UnsupportedOpError(f"Resize node {node.name!r}: mode {mode!r} is not supported")


def _resize_check(node: OpNode, proto: onnx.NodeProto) -> str | None:
    if node.get("antialias", 0):
        return "antialias=1 is not supported"
    if node.get("mode", "nearest") not in ("nearest", "linear", "cubic", "bilinear", "trilinear"):
        return f"mode {node.get('mode')!r} is not supported"
    return None


def _sizes_and_scales(node: OpNode, in_shape: list[int], rank: int, axes: list[int], roi_t: Tensor | None,
                      scales_t: Tensor | None, sizes_t: Tensor | None) -> tuple[list[int], list[np.float32]]:
    """The output size and the scale of each resized axis, from ``sizes`` if given, else ``scales``."""
    f = np.float32
    if sizes_t is not None:
        sizes = ints(sizes_t)
        policy = node.get("keep_aspect_ratio_policy", "stretch")
        if policy == "stretch":
            return sizes, [f(o) / f(i) for o, i in zip(sizes, in_shape)]
        ratios = [f(o) / f(i) for o, i in zip(sizes, in_shape)]
        s = min(ratios) if policy == "not_larger" else max(ratios)
        return [int(math.floor(float(s) * i + 0.5)) for i in in_shape], [s] * len(axes)
    scales = [f(s) for s in floats(scales_t)]
    if len(scales) == rank and len(axes) != rank:
        scales = [scales[a] for a in axes]
    sizes = []
    rois = floats(roi_t)
    for k, (i, s) in enumerate(zip(in_shape, scales)):
        span = f(1)
        if node.get("coordinate_transformation_mode") == "tf_crop_and_resize" and rois:
            span = f(rois[len(axes) + k] - rois[k])
        sizes.append(int(f(i) * span * s))
    return sizes, scales


def _resized(node: OpNode, t: Tensor, roi_t: Tensor | None, scales_t: Tensor | None, sizes_t: Tensor | None,
             legacy: bool) -> Tensor:
    """``t`` resized; ``legacy`` (Upsample, Resize-10): asymmetric coordinates, the simple nearest mode."""
    rank = t.dim()
    mode = node.get("mode", "nearest")
    mode = "linear" if mode in ("bilinear", "trilinear") else mode
    axes = [axis_of(a, rank) for a in node.get("axes", [])] or list(range(rank))
    sizes, scales = _sizes_and_scales(node, [t.shape[a] for a in axes], rank, axes, roi_t, scales_t, sizes_t)
    rois = floats(roi_t)
    ctm = node.get("coordinate_transformation_mode", "half_pixel")
    outside_masks: list[Tensor] = []
    for k, (axis, out_len, scale) in enumerate(zip(axes, sizes, scales)):
        roi = (rois[k], rois[len(axes) + k]) if rois else (0.0, 1.0)
        if out_len == t.shape[axis] and scale == 1 and ctm != "tf_crop_and_resize":
            continue
        t, outside = _resize_axis(t, axis, out_len, scale, roi, node, mode, legacy)
        if outside is not None:
            view = [1] * rank
            view[axis] = out_len
            outside_masks.append(outside.reshape(view))
    if outside_masks:
        mask = outside_masks[0]
        for m in outside_masks[1:]:
            mask = mask | m
        t = torch.where(mask, torch.tensor(node.get("extrapolation_value", 0.0), dtype=t.dtype, device=t.device), t)
    return t


def _upsample_7(node: OpNode, x: Inputs) -> Tensor:
    """Upsample before opset 9: the scales are an attribute."""
    return _resized(node, x[0], None, torch.tensor(node.get("scales")), None, legacy=True)


def _scales_input(node: OpNode, x: Inputs) -> Tensor:
    """Upsample from opset 9, Resize 10: the scales are an input."""
    return _resized(node, x[0], None, given(x, 1), None, legacy=True)


def _resize_11(node: OpNode, x: Inputs) -> Tensor:
    """Resize from opset 11: roi, scales, sizes inputs."""
    return _resized(node, x[0], given(x, 1), given(x, 2), given(x, 3), legacy=False)


register(OpEntry("Resize", channels=_resize_rule, torch={10: _scales_input, 11: _resize_11},
                 static_inputs=frozenset({1, 2, 3}), check=_resize_check))
register(OpEntry("Upsample", channels=_resize_rule, torch={1: _upsample_7, 9: _scales_input},
                 static_inputs=frozenset({1, 2, 3}), check=_resize_check))
