"""One error hierarchy: every message names the file/node/tensor at fault and the way out."""

from __future__ import annotations


class OnnxPruneError(Exception):
    """Base class of every error onnxprune raises on purpose (the CLI prints it as one line).

    ``option``: the argument or option at fault, where one is (e.g. ``"input_shape"``); the message names it as
    the library spells it, and the CLI adds its flag (``--input-shape``)."""

    def __init__(self, *args: object, option: str | None = None) -> None:
        super().__init__(*args)
        self.option = option


class ModelError(OnnxPruneError):
    """The model file is missing, not ONNX, truncated, or fails the checker."""


class AnalysisError(OnnxPruneError):
    """The graph cannot be analysed (e.g. no prunable channel group)."""


class ShapeError(AnalysisError):
    """A node's shapes, which its MAC count needs, are not known statically (after a Loop, a data-dependent op)."""


class UnsupportedOpError(OnnxPruneError):
    """An op the evaluator/pass registry does not know."""


class CalibrationError(OnnxPruneError):
    """Calibration data is missing, empty, unreadable or does not fit the model input."""


class TargetError(OnnxPruneError):
    """The requested MAC budget cannot be met."""


class OutputError(OnnxPruneError):
    """The output path is invalid (e.g. equal to the input)."""


class ResourceError(OnnxPruneError):
    """Not enough memory or disk for the work asked (e.g. the cached activations of a large calibration set)."""


class OptionError(OnnxPruneError, ValueError):
    """An option is outside its choices or range (a ValueError too, as the library raised before)."""


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """OptionError listing ``choices`` unless ``value`` is one of them (its ``option`` is ``name``)."""
    if value not in choices:
        raise OptionError(f"{name} {value!r} is not one of {', '.join(choices)}", option=name)
