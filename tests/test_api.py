"""The Python API: options and strategies validated when built, naming the valid choices."""

from __future__ import annotations

import pytest

from onnxprune.compress import CompressOptions
from onnxprune.errors import OnnxPruneError
from onnxprune.recovery import RecoverOptions


@pytest.mark.parametrize(("field", "value", "choices"), [
    ("reconstruct", "ful", "none, scale, full"),
    ("allocation", "unifrom", "uniform, epsilon, curve"),
    ("method", "magic", "local, omp, global, l1, random"),
    ("target", "papers", "original, paper"),
])
def test_compress_options_refuse_unknown_strategies(field: str, value: str, choices: str) -> None:
    with pytest.raises(OnnxPruneError, match=f"{field} '{value}' is not one of {choices}"):
        CompressOptions(target_ratio=0.5, **{field: value})


@pytest.mark.parametrize(("field", "value", "choices"), [
    ("method", "blocks", "block\\+distill, block, distill"),
    ("train", "all", "segment, changed"),
    ("mix", "mixin", "mixup, cutmix, none"),
])
def test_recover_options_refuse_unknown_strategies(field: str, value: str, choices: str) -> None:
    with pytest.raises(OnnxPruneError, match=f"{field} '{value}' is not one of {choices}"):
        RecoverOptions(**{field: value})
