"""The Python API: models and calibration data from what the CLI accepts, and the commands as functions.

The CLI parses its flags into these arguments and calls the same functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np
import onnx

from onnxprune.analysis import Analysis, analyze as _analyze
from onnxprune.analysis.graph import load_model, specialise_inputs
from onnxprune.calib.images import Preprocess
from onnxprune.calib.sources import CalibrationSet, load_calibration, preprocess_for
from onnxprune.pipeline import CompressReport, compress as _prune
from onnxprune.errors import OptionError
from onnxprune.fileio import save_model
from onnxprune.recovery import Progress, RecoverOptions, RecoverReport, recover as _recover
from onnxprune.runtime.ort import model_input_specs
from onnxprune.strategies import OMP, Allocator, Budget, Epsilon, Reconstruction, Refit, Selector, options_from

ModelSource = Union[str, Path, onnx.ModelProto]
# A folder of images, a .npy/.npz file, 'file.py:fn' or 'package.module:fn', an array or a dict of arrays
# (samples first), an onnxruntime CalibrationDataReader, or a CalibrationSet used as it is.
CalibSource = Union[str, Path, np.ndarray, Mapping[str, np.ndarray], CalibrationSet, Any]


@dataclass
class Result:
    """A pruned or recovered model and the report of the run."""

    model: onnx.ModelProto
    report: CompressReport | RecoverReport

    def save(self, path: str | Path, refuse: Iterable[str | Path] = ()) -> Path:
        """Write the model to ``path`` atomically (never a half file; never onto a path in ``refuse``)."""
        return save_model(self.model, Path(path), [Path(p) for p in refuse])


def load(model: ModelSource, input_shape: Sequence[str] | None = None) -> onnx.ModelProto:
    """``model`` (a path, read and checked, or a ModelProto) with its dynamic dims other than the batch fixed
    from ``input_shape`` (``["1x3x224x224"]`` or ``["name:1x3x320x320", ...]``, as ``--input-shape``)."""
    if isinstance(model, onnx.ModelProto):
        return specialise_inputs(model, input_shape, model.graph.name or "the model")
    return specialise_inputs(load_model(model), input_shape, str(model))


def calibration(calib: CalibSource, model: onnx.ModelProto, preprocess: Preprocess | None = None, *,
                subset: str | None = None, limit: int | None = None, flip: bool = False) -> CalibrationSet:
    """The calibration set of ``calib`` for ``model``'s inputs. Images go through ``preprocess`` (default:
    ImageNet's, cropped to the input's H,W; see ``preprocess_for``); ``subset`` (e.g. '0:400', '0%5'), then
    ``limit`` pick samples; ``flip`` adds each image's mirror."""
    if isinstance(calib, CalibrationSet):
        if subset is not None or limit is not None or flip:
            raise OptionError("subset, limit and flip do not apply to a CalibrationSet: pick its samples when "
                              "building it")
        return calib
    specs = model_input_specs(model)
    return load_calibration(calib, specs, preprocess=preprocess or preprocess_for(specs), subset=subset,
                            limit=limit, flip=flip)


def analyze(model: ModelSource, input_shape: Sequence[str] | None = None) -> Analysis:
    """The channel groups of ``model`` (prunable or not, with the reason), its MACs and parameters."""
    return _analyze(load(model, input_shape))


def compress(
    model: ModelSource,
    calib: CalibSource,
    *,
    budget: Budget,
    select: Selector = OMP(),
    allocate: Allocator = Epsilon(),
    reconstruct: Reconstruction = Refit(),
    preprocess: Preprocess | None = None,
    input_shape: Sequence[str] | None = None,
    subset: str | None = None,
    limit: int | None = None,
    flip: bool = False,
    round_to: int = 8,
    batch_size: int = 32,
    provider: str = "auto",
    best_effort: bool = False,
    on_layer: Callable[[int, int, str], None] | None = None,
) -> Result:
    """Prune ``model``'s channels to ``budget`` (``MACs``, ``Ratio`` or ``Latency``) on the samples of ``calib``.

    ``select`` picks the channels, ``allocate`` the widths, ``reconstruct`` the consumers' new weights (see
    ``onnxprune.strategies``). Widths are multiples of ``round_to``; ``best_effort`` prunes to the lowest
    reachable budget instead of failing; ``on_layer(i, total, label)`` reports progress. The written model
    keeps a dynamic batch dim, with the other dims fixed by ``input_shape``."""
    options = options_from(budget, select, allocate, reconstruct, round_to=round_to, batch_size=batch_size,
                           provider=provider, best_effort=best_effort)
    onnx_model = load(model, input_shape)
    data = calibration(calib, onnx_model, preprocess, subset=subset, limit=limit, flip=flip)
    return Result(*_prune(onnx_model, data, options, on_layer))


def recover(
    model: ModelSource,
    teacher: ModelSource,
    calib: CalibSource,
    *,
    options: RecoverOptions | None = None,
    held: CalibSource | None = None,
    preprocess: Preprocess | None = None,
    input_shape: Sequence[str] | None = None,
    subset: str | None = None,
    limit: int | None = None,
    flip: bool = False,
    on_progress: Progress | None = None,
) -> Result:
    """Few-shot recovery of the pruned ``model`` towards ``teacher`` on ``calib`` (see ``RecoverOptions``);
    never worse on the held-out samples: ``held`` (samples the pruner did not see), else a split of ``calib``."""
    student, teacher_model = load(model, input_shape), load(teacher, input_shape)
    data = calibration(calib, teacher_model, preprocess, subset=subset, limit=limit, flip=flip)
    held_set = None if held is None else calibration(held, teacher_model, preprocess)
    return Result(*_recover(student, teacher_model, data, options or RecoverOptions(), on_progress, held_set))
