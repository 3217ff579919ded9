"""The op registry: per ONNX op type, everything the tool knows of it, in one entry.

One module per op family (``elementwise``, ``arithmetic``, ``control``, ``conv``, ``linear``, ``norm``, ``pool``,
``recurrent``, ``reduce``, ``shape``, ``concat_split``, ``resize``, ``tensor``) registers its ops' ``OpEntry``: the
channel rule (analysis), the MAC count, the weights as a matrix (re-fitting consumers), how slicing
rewrites its bounds, and its torch kernels by opset. Teaching the tool a new op is one call::

    register(OpEntry("Shrink", channels=pointwise, torch={9: shrink}))
"""

from onnxprune.ops.registry import Linear, Mixing, OpEntry, lookup, register, registered
from onnxprune.ops import (  # noqa: F401  (each registers its ops)
    arithmetic,
    concat_split,
    control,
    conv,
    elementwise,
    linear,
    norm,
    pool,
    recurrent,
    reduce,
    resize,
    shape,
    tensor,
)

__all__ = ["Linear", "Mixing", "OpEntry", "lookup", "register", "registered"]
