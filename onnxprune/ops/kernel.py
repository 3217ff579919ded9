"""What a torch kernel of ``onnxprune.ops`` sees (``OpNode``, its inputs) and the helpers kernels share.

A kernel is ``fn(node: OpNode, inputs: list[Tensor | None]) -> Tensor | Sequence[Tensor]``; absent
optional inputs are None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from onnx import TensorProto

from onnxprune.errors import UnsupportedOpError

Tensor = torch.Tensor
Inputs = list[Tensor | None]
OpFn = Callable[["OpNode", Inputs], "Tensor | Sequence[Tensor]"]


@dataclass(frozen=True)
class OpNode:
    """What a kernel sees of its node: parsed attributes and a little context."""

    name: str
    op_type: str
    attrs: dict[str, Any]
    num_outputs: int

    def get(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


_DTYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT8: torch.int8,
    TensorProto.INT16: torch.int16,
    TensorProto.INT32: torch.int32,
    TensorProto.INT64: torch.int64,
    TensorProto.UINT8: torch.uint8,
    TensorProto.UINT16: torch.uint16,
    TensorProto.UINT32: torch.uint32,
    TensorProto.UINT64: torch.uint64,
    TensorProto.BOOL: torch.bool,
}


def onnx_to_torch_dtype(elem_type: int) -> torch.dtype:
    """The torch dtype of an ONNX ``TensorProto.DataType``."""
    if elem_type not in _DTYPES:
        raise UnsupportedOpError(
            f"ONNX tensor type {TensorProto.DataType.Name(elem_type)} has no torch equivalent in the evaluator"
        )
    return _DTYPES[elem_type]


def ints(t: Tensor | None) -> list[int]:
    if t is None:
        return []
    return [int(v) for v in t.reshape(-1).tolist()]


def floats(t: Tensor | None) -> list[float]:
    if t is None:
        return []
    return [float(v) for v in t.reshape(-1).tolist()]


def given(inputs: Inputs, i: int) -> Tensor | None:
    """Input ``i`` if present and not an empty tensor (ONNX marks absent optionals both ways)."""
    if i < len(inputs) and inputs[i] is not None and inputs[i].numel() > 0:
        return inputs[i]
    return None


def opt(inputs: Inputs, i: int) -> Tensor | None:
    return inputs[i] if i < len(inputs) else None


def axis_of(axis: int, rank: int) -> int:
    """A possibly negative ONNX axis as an index."""
    return axis + rank if axis < 0 else axis


def is_float(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def unary(f: Callable[[Tensor], Tensor]) -> OpFn:
    return lambda node, x: f(x[0])


def binary(f: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    return lambda node, x: f(x[0], x[1])
