"""Calibration sources: image folders, .npy/.npz files, Python callables and ORT data readers."""

from __future__ import annotations

import importlib
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD, Preprocess, list_images, open_image, select
from onnxprune.errors import CalibrationError
from onnxprune.ir.ort import InputSpec
from onnxprune.ir.shapes import onnx_infer

SOURCE_FORMS = ("an image folder, a .npy/.npz file, 'path/to/file.py:fn', 'package.module:fn', or an array "
                "(dict of arrays)")


class CalibrationSet(ABC):
    """A fixed, re-iterable set of model inputs, delivered in batches."""

    input_names: list[str]

    @abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @abstractmethod
    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Feeds ``{input name: array with a leading batch dim}`` of at most ``batch_size`` samples."""

    def take(self, indices: Sequence[int]) -> CalibrationSet:
        """The samples ``indices`` (increasing) of this set, as a set of their own (decoded into memory here; the
        sets that can pick their samples without decoding them do so)."""
        wanted, parts, offset = np.asarray(indices, dtype=np.int64), {k: [] for k in self.input_names}, 0
        for feed in self.batches(64):
            n = len(next(iter(feed.values())))
            rows = wanted[(wanted >= offset) & (wanted < offset + n)] - offset
            for k, v in feed.items():
                parts[k].append(v[rows])
            offset += n
        arrays = {k: np.concatenate(v) for k, v in parts.items()}
        return ArraySet(arrays, np.arange(len(wanted)), {k: a.dtype for k, a in arrays.items()})


class ImageFolderSet(CalibrationSet):
    """Images preprocessed lazily, one batch at a time; with ``flip`` each image is followed by its mirror."""

    def __init__(self, paths: list[Path], input_name: str, preprocess: Preprocess, dtype: np.dtype, flip: bool):
        self.paths = paths
        self.input_names = [input_name]
        self.preprocess = preprocess
        self.dtype = dtype
        self.flip = flip

    def __len__(self) -> int:
        return len(self.paths) * (2 if self.flip else 1)

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        items = [(p, f) for p in self.paths for f in ((False, True) if self.flip else (False,))]
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            arrays = [self.preprocess(path, flip=flip) for path, flip in chunk]
            for (path, _), x in zip(chunk, arrays):
                if x.shape != arrays[0].shape:
                    raise CalibrationError(
                        f"image {path} preprocesses to {x.shape}, {chunk[0][0]} to {arrays[0].shape}: "
                        "set a crop so all images get the same size", option="crop"
                    )
            yield {self.input_names[0]: np.stack(arrays).astype(self.dtype, copy=False)}

    def take(self, indices: Sequence[int]) -> CalibrationSet:
        if self.flip:  # a sample is an image or its mirror
            return super().take(indices)
        return ImageFolderSet([self.paths[i] for i in indices], self.input_names[0], self.preprocess, self.dtype,
                              False)


class ArraySet(CalibrationSet):
    """Samples ``indices`` of in-memory or memory-mapped arrays (one per input, same leading length)."""

    def __init__(self, arrays: dict[str, np.ndarray], indices: np.ndarray, dtypes: dict[str, np.dtype]):
        self.arrays = arrays
        self.indices = indices
        self.dtypes = dtypes
        self.input_names = list(arrays)

    def __len__(self) -> int:
        return len(self.indices)

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(self.indices), batch_size):
            idx = self.indices[start : start + batch_size]
            yield {k: np.asarray(a[idx], dtype=self.dtypes[k]) for k, a in self.arrays.items()}

    def take(self, indices: Sequence[int]) -> CalibrationSet:
        return ArraySet(self.arrays, self.indices[np.asarray(indices, dtype=np.int64)], self.dtypes)


class LazySet(CalibrationSet):
    """Samples produced by Python code, collected into an ArraySet on first use (then reused every pass)."""

    def __init__(self, input_names: list[str], produce: Callable[[], ArraySet]):
        self.input_names = input_names
        self._produce = produce
        self._set: ArraySet | None = None

    def _materialised(self) -> ArraySet:
        if self._set is None:
            self._set = self._produce()
        return self._set

    def __len__(self) -> int:
        return len(self._materialised())

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        return self._materialised().batches(batch_size)

    def take(self, indices: Sequence[int]) -> CalibrationSet:
        return self._materialised().take(indices)


def load_calibration(
    spec: str | Path | Any,
    input_specs: list[InputSpec],
    *,
    preprocess: Preprocess | None = None,
    subset: str | None = None,
    limit: int | None = None,
    flip: bool = False,
) -> CalibrationSet:
    """The calibration set described by ``spec`` for a model with inputs ``input_specs``.

    ``spec`` is an image folder, a ``.npy`` (single input) or ``.npz`` (keys = input names) file,
    ``"path/to/file.py:fn"`` / ``"package.module:fn"`` (a callable returning an iterable of arrays
    or dicts of arrays, each one sample or a batch), an object with ``get_next()`` (an
    onnxruntime CalibrationDataReader), or samples in memory: an array (single input) or a dict of
    arrays (keys = input names), the first dim counting samples. ``subset`` (see ``select``) then
    ``limit`` (first N) pick samples; ``flip`` (image folders only) adds each image's horizontal mirror.
    """
    if isinstance(spec, (str, Path)) and Path(spec).is_dir():
        return load_image_folder(spec, input_specs, preprocess=preprocess, subset=subset, limit=limit, flip=flip)
    _check_limit(limit)
    if flip:
        raise CalibrationError(f"flip applies to image folders only, not {spec}: drop it", option="flip")
    if hasattr(spec, "get_next"):
        return _python_set(lambda: iter(spec.get_next, None), type(spec).__name__, input_specs, subset, limit)
    if isinstance(spec, np.ndarray):
        spec = {_single_input(input_specs, "an array")[0]: spec}
    if isinstance(spec, Mapping):
        _require_keys(spec.keys(), input_specs, "the arrays")
        arrays = {name: np.asarray(spec[name]) for name, _, _ in input_specs}
        _check_arrays(arrays, input_specs, "the arrays")
        return _array_set(arrays, input_specs, subset, limit, "the arrays")
    if not isinstance(spec, (str, Path)):
        raise CalibrationError(f"unsupported calibration source {type(spec).__name__}: give {SOURCE_FORMS}")
    if Path(spec).suffix.lower() in (".npy", ".npz"):
        return _file_set(Path(spec), input_specs, subset, limit)
    target, sep, fn_name = str(spec).rpartition(":")
    if not sep or not target or not fn_name:
        raise CalibrationError(f"calibration source {spec} not found: give {SOURCE_FORMS}")
    return _python_set(_load_callable(target, fn_name), str(spec), input_specs, subset, limit)


def mirrors_by_default(model: onnx.ModelProto) -> bool:
    """Whether an image folder calibrating ``model`` gets each image's mirror by default (``--flip``): where the
    model is a classifier (its first output 2-D, one row of scores per image), which a mirrored photo asks the same
    question. The refits then fit on twice the samples: MobileNetV2 at 170M MACs went 55.8% -> 59.4% top-1 on 500
    unseen photos (5 folds), 245M 82.5% -> 83.0% on 200 (agreement 89.5% -> 90.5%; docs/results.md "Mirrored
    calibration"). Not for dense outputs: YOLOv8n's refits at 0.70x lost mAP with mirrors (0.830 -> 0.703, the
    notebook)."""
    output = model.graph.output[0]
    if not output.type.tensor_type.HasField("shape"):
        try:
            output = next(o for o in onnx_infer(model).graph.output if o.name == output.name)
        except Exception:  # inference is best effort: an unknown rank is not a classifier's
            return False
    return output.type.tensor_type.HasField("shape") and len(output.type.tensor_type.shape.dim) == 2


def preprocess_for(
    input_specs: list[InputSpec], *, resize: int | None = None, crop: int | None = None,
    mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD, layout: str = "auto",
    bgr: bool = False,
) -> Preprocess:
    """The image preprocessing for a model with inputs ``input_specs``: without ``crop``, the crop is the
    single input's static H,W (else 224), and without ``resize`` the short side is resized to crop·256/224
    (ImageNet's 256 → 224). ``layout`` 'auto' is 'nhwc' for a single 4-D input whose last dim is 1, 3 or 4 and
    whose second is not (a Keras or TF export), else 'nchw'."""
    if layout == "auto":
        dims = input_specs[0][1] if len(input_specs) == 1 else []
        layout = "nhwc" if len(dims) == 4 and dims[3] in (1, 3, 4) and dims[1] not in (1, 3, 4) else "nchw"
    size: int | tuple[int, int] = crop or 224
    if crop is None and len(input_specs) == 1 and len(input_specs[0][1]) == 4:
        hw = input_specs[0][1][2:4] if layout == "nchw" else input_specs[0][1][1:3]
        if all(isinstance(d, int) and d > 0 for d in hw):
            size = hw[0] if hw[0] == hw[1] else (hw[0], hw[1])
    if resize is None:
        resize = round(min(size if isinstance(size, tuple) else (size,)) * 256 / 224)
    return Preprocess(resize=resize, crop=size, mean=mean, std=std, layout=layout, bgr=bgr)


def _check_limit(limit: int | None) -> None:
    """CalibrationError unless ``limit`` is None or positive."""
    if limit is not None and limit <= 0:
        raise CalibrationError(f"calibration limit must be positive, got {limit}", option="limit")


def _single_input(input_specs: list[InputSpec], source: str) -> InputSpec:
    """The model's only input; CalibrationError if it has several."""
    if len(input_specs) != 1:
        names = ", ".join(name for name, _, _ in input_specs)
        raise CalibrationError(
            f"{source} feeds one input but the model has {len(input_specs)} ({names}): use a .npz with those keys "
            "or a Python source yielding dicts"
        )
    return input_specs[0]


def _fits(sample_shape: Sequence[int], spec_shape: Sequence[int | str | None]) -> bool:
    """Whether a per-sample shape matches the static dims of an input shape without its batch dim."""
    return len(sample_shape) == len(spec_shape) - 1 and all(
        not isinstance(d, int) or d == s for s, d in zip(sample_shape, spec_shape[1:])
    )


def load_image_folder(
    folder: str | Path,
    input_specs: list[InputSpec],
    *,
    preprocess: Preprocess | None = None,
    subset: str | None = None,
    limit: int | None = None,
    flip: bool = False,
) -> ImageFolderSet:
    """An image-folder set, checked up front: every file's header is readable and the first image fits the input.

    With ``preprocess.crop`` None the crop is the input's static H,W (if it has them); an input of one
    channel gets grayscale images.
    """
    _check_limit(limit)
    preprocess = preprocess or Preprocess()
    name, shape, dtype = _single_input(input_specs, f"image folder {folder}")
    if len(shape) != 4:
        raise CalibrationError(f"input {name!r} of shape {list(shape)} is not an image batch: use a .npy/.npz source")
    if preprocess.crop is None:
        hw = shape[2:4] if preprocess.layout == "nchw" else shape[1:3]
        if all(isinstance(d, int) and d > 0 for d in hw):
            preprocess = replace(preprocess, crop=(hw[0], hw[1]))
    if (shape[1] if preprocess.layout == "nchw" else shape[3]) == 1:
        preprocess = replace(preprocess, gray=True)
    paths = select(list_images(folder), subset)[:limit]
    for path in paths:  # headers only: cheap, and a bad file fails now rather than mid-run
        with open_image(path):
            pass
    sample = preprocess(paths[0])
    if not _fits(sample.shape, shape):
        raise CalibrationError(
            f"images in {folder} preprocess to {list(sample.shape)} ({preprocess.layout}) but input {name!r} expects "
            f"{list(shape[1:])}: set the crop to the model's H,W and/or the layout (nchw|nhwc)", option="crop"
        )
    return ImageFolderSet(paths, name, preprocess, dtype, flip)


def _file_set(path: Path, input_specs: list[InputSpec], subset: str | None, limit: int | None) -> ArraySet:
    """An ArraySet from a .npy (memory-mapped, single input) or .npz (keys = input names) file."""
    if not path.is_file():
        raise CalibrationError(f"calibration file {path} not found: check the path")
    try:
        if path.suffix.lower() == ".npy":
            arrays = {_single_input(input_specs, str(path))[0]: np.load(path, mmap_mode="r")}
        else:
            with np.load(path) as npz:
                _require_keys(npz.files, input_specs, str(path))
                arrays = {name: npz[name] for name, _, _ in input_specs}
    except (OSError, ValueError) as e:
        raise CalibrationError(f"cannot read {path}: {e}; re-save it with numpy.save/savez") from e
    _check_arrays(arrays, input_specs, str(path))
    return _array_set(arrays, input_specs, subset, limit, str(path))


def _require_keys(keys: Iterable[str], input_specs: list[InputSpec], source: str) -> None:
    """CalibrationError if ``keys`` lacks a model input name."""
    present = set(keys)
    missing = [name for name, _, _ in input_specs if name not in present]
    if missing:
        expected = ", ".join(name for name, _, _ in input_specs)
        raise CalibrationError(f"{source} lacks input(s) {', '.join(missing)}: provide arrays named {expected}")


def _check_arrays(arrays: Mapping[str, np.ndarray], input_specs: list[InputSpec], source: str) -> None:
    """CalibrationError unless each array has its input's rank, static dims (after the batch dim) and dtype kind."""
    for name, shape, dtype in input_specs:
        a = arrays[name]
        if not _fits(a.shape[1:], shape):
            raise CalibrationError(
                f"{source}: input {name!r} expects (samples, {', '.join(map(str, shape[1:]))}) but got {a.shape}: "
                "re-export the data with the model's input shape"
            )
        if not np.can_cast(a.dtype, dtype, "same_kind"):
            raise CalibrationError(f"{source}: input {name!r} is {dtype} but the data is {a.dtype}: convert the data")


def _array_set(
    arrays: Mapping[str, np.ndarray], input_specs: list[InputSpec], subset: str | None, limit: int | None,
    source: str,
) -> ArraySet:
    """An ArraySet of the samples picked by ``subset`` then ``limit``, once the sample counts agree."""
    counts = {name: len(a) for name, a in arrays.items()}
    if len(set(counts.values())) != 1:
        raise CalibrationError(f"{source}: inputs have different sample counts {counts}: give each the same number")
    indices = np.asarray(select(range(next(iter(counts.values()))), subset)[:limit], dtype=np.int64)
    return ArraySet({name: arrays[name] for name, _, _ in input_specs}, indices, {n: d for n, _, d in input_specs})


def _load_callable(target: str, fn_name: str) -> Callable[[], Iterable[Any]]:
    """The function ``fn_name`` of a ``.py`` file or an importable module."""
    try:
        if target.endswith(".py"):
            file = Path(target)
            if not file.is_file():
                raise CalibrationError(f"calibration script {file} not found: check the path before ':{fn_name}'")
            module_spec = importlib.util.spec_from_file_location(file.stem, file)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as e:
        raise CalibrationError(f"cannot import {target} ({e}): check the module name or give path/to/file.py:fn") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise CalibrationError(f"{target} has no function {fn_name!r}: check the name after ':'")
    return fn


def _python_set(
    produce: Callable[[], Iterable[Any]], source: str, input_specs: list[InputSpec], subset: str | None,
    limit: int | None,
) -> LazySet:
    """A LazySet collecting the arrays/dicts yielded by ``produce()`` (stopping early at ``limit`` if no subset)."""

    def collect() -> ArraySet:
        feeds: list[dict[str, np.ndarray]] = []
        count = 0
        for item in produce():
            feed = _as_feed(item, input_specs, source)
            feeds.append(feed)
            count += len(next(iter(feed.values())))
            if subset is None and limit is not None and count >= limit:
                break
        if not feeds:
            raise CalibrationError(f"{source} yielded no samples: make it return at least one array")
        arrays = {name: np.concatenate([f[name] for f in feeds]) for name, _, _ in input_specs}
        return _array_set(arrays, input_specs, subset, limit, source)

    return LazySet([name for name, _, _ in input_specs], collect)


def _as_feed(item: Any, input_specs: list[InputSpec], source: str) -> dict[str, np.ndarray]:
    """One yielded item as ``{input: batch array}``; a single sample (rank one less than the input) gets a batch dim."""
    if isinstance(item, Mapping):
        _require_keys(item.keys(), input_specs, source)
        feed = {name: np.asarray(item[name]) for name, _, _ in input_specs}
    else:
        feed = {_single_input(input_specs, source)[0]: np.asarray(item)}
    ranks = {name: len(shape) for name, shape, _ in input_specs}
    feed = {name: a[None] if a.ndim == ranks[name] - 1 else a for name, a in feed.items()}
    _check_arrays(feed, input_specs, source)
    return feed
