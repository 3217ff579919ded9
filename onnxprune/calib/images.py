"""Image preprocessing, label parsing, image listing and deterministic subsets."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np
from PIL import Image

from onnxprune.errors import CalibrationError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})
SUBSET_FORMS = ("'start:stop[:step]' (e.g. '0:400', '::2'), '!start:stop' (the rest), 'k%n' (index % n == k), "
                "'!k%n' (index % n != k); k may be a list: '1,2%5', '!0,1%5'; '&' intersects forms: '!0:125&!1%5'")

T = TypeVar("T")


@dataclass(frozen=True)
class Preprocess:
    """Resize the short side, centre-crop, scale, normalise and lay out an image file.

    ``mean``/``std`` are in RGB order and are applied to ``pixel * scale`` before the optional
    RGB->BGR swap, so the ImageNet defaults stay right with ``bgr=True``. ``crop`` is a side or an
    ``(height, width)``; ``None`` keeps the resized image (callers fill it in from a model input).
    The short side is never resized below the crop, so the crop always fits. ``gray`` gives one channel
    (luminance, normalised by the means of ``mean`` and ``std``), for models that read grayscale.
    """

    resize: int | None = 256
    crop: int | tuple[int, int] | None = 224
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    scale: float = 1 / 255
    layout: Literal["nchw", "nhwc"] = "nchw"
    bgr: bool = False
    gray: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("nchw", "nhwc"):
            raise CalibrationError(f"unknown layout {self.layout!r}: use nchw or nhwc", option="layout")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise CalibrationError(f"mean {self.mean} and std {self.std} need 3 values each (R,G,B)",
                                   option="mean" if len(self.mean) != 3 else "std")

    @property
    def crop_hw(self) -> tuple[int, int] | None:
        """The crop as ``(height, width)``, or None."""
        if self.crop is None:
            return None
        return (self.crop, self.crop) if isinstance(self.crop, int) else (int(self.crop[0]), int(self.crop[1]))

    def __call__(self, path: str | Path, *, flip: bool = False) -> np.ndarray:
        """Load ``path`` as a float32 ``(C,H,W)`` (nchw) or ``(H,W,C)`` (nhwc) array; ``flip`` mirrors it."""
        with open_image(path) as im:
            img = im.convert("L" if self.gray else "RGB")
        if flip:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        img = self._resize(img)
        if (hw := self.crop_hw) is not None:
            h, w = hw
            left, top = (img.width - w) // 2, (img.height - h) // 2
            img = img.crop((left, top, left + w, top + h))
        x = np.asarray(img, dtype=np.float32) * np.float32(self.scale)
        if self.gray:
            x = ((x - np.float32(np.mean(self.mean))) / np.float32(np.mean(self.std)))[..., None]
        else:
            x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        if self.bgr and not self.gray:
            x = x[..., ::-1]
        if self.layout == "nchw":
            x = x.transpose(2, 0, 1)
        return np.ascontiguousarray(x, dtype=np.float32)

    def _resized(self, w: int, h: int) -> tuple[int, int]:
        """The size an image of ``w``×``h`` is resized to: short side ``resize``, or just large enough for the crop."""
        ch, cw = self.crop_hw or (0, 0)
        factor = self.resize / min(w, h) if self.resize is not None else 1.0
        factor = max(factor, ch / h, cw / w)
        return max(round(w * factor), cw), max(round(h * factor), ch)

    def _resize(self, img: Image.Image) -> Image.Image:
        """Bilinear resize to ``_resized``."""
        size = self._resized(*img.size)
        if size == img.size:
            return img
        return img.resize(size, Image.Resampling.BILINEAR)

    def placement(self, w: int, h: int) -> tuple[float, float, int, int]:
        """Where a ``w``×``h`` image's pixels land in the input: (sx, sy, left, top), x' = x·sx − left and
        y' = y·sy − top (the resize, then the centre crop)."""
        rw, rh = self._resized(w, h)
        ch, cw = self.crop_hw or (rh, rw)
        return rw / w, rh / h, (rw - cw) // 2, (rh - ch) // 2


@contextmanager
def open_image(path: str | Path) -> Iterator[Image.Image]:
    """``PIL.Image.open(path)``, turning a missing/unreadable/truncated file into CalibrationError naming it."""
    try:
        with Image.open(path) as im:
            yield im
    except (OSError, ValueError) as e:
        raise CalibrationError(f"cannot read image {path}: {e}; remove or replace the file") from e


def label_from_name(path: str | Path) -> int | None:
    """The leading integer of the file name (``042_n01687978_agama.jpg`` -> 42), or None."""
    m = re.match(r"\d+", Path(path).name)
    return int(m.group()) if m else None


def list_images(directory: str | Path) -> list[Path]:
    """All images (.jpg/.jpeg/.png/.bmp/.webp, any case) under ``directory``, recursively, sorted.

    Raises CalibrationError if ``directory`` is not a folder or holds no image.
    """
    root = Path(directory)
    if not root.is_dir():
        raise CalibrationError(f"image folder {root} not found: pass an existing folder of images")
    paths = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not paths:
        raise CalibrationError(
            f"no images in {root}: add {'/'.join(sorted(IMAGE_SUFFIXES))} files or point to another folder"
        )
    return paths


def select(items: Sequence[T], spec: str | None) -> list[T]:
    """The deterministic subset of ``items`` given by ``spec`` (None = all), in their order.

    Forms: ``start:stop[:step]`` (a Python slice) and ``!start:stop[:step]`` (the items it leaves out), ``k%n``
    (index % n == k) and ``!k%n`` (index % n != k, the complement of ``k%n``), where k may be a comma-separated list
    of residues (``!0,1%5``: index % 5 not in {0, 1}). ``&`` intersects forms: ``!0:125&!1%5`` is every index from
    125 on whose residue mod 5 is not 1 (a split by class range, with a held-out part of the rest). Raises
    CalibrationError for a bad spec or an empty selection.
    """
    if spec is None:
        return list(items)
    keep = np.ones(len(items), dtype=bool)
    for part in spec.replace(" ", "").split("&"):
        keep &= _mask(part, len(items), spec)
    chosen = [x for x, k in zip(items, keep) if k]
    if not chosen:
        raise CalibrationError(f"subset {spec!r} selects none of the {len(items)} items: widen it",
                               option="subset")
    return chosen


def _mask(part: str, n_items: int, spec: str) -> np.ndarray:
    """Which of ``n_items`` indices one form of a subset ``spec`` (no '&') selects."""
    index = np.arange(n_items)
    negate, text = part.startswith("!"), part.removeprefix("!")
    if m := re.fullmatch(r"(\d+(?:,\d+)*)%(\d+)", text):
        ks, n = {int(k) for k in m.group(1).split(",")}, int(m.group(2))
        if n == 0 or max(ks) >= n:
            raise CalibrationError(f"bad subset {spec!r}: 'k%n' needs 0 <= k < n; accepted forms: {SUBSET_FORMS}")
        chosen = np.isin(index % n, list(ks))
    elif re.fullmatch(r"(-?\d+)?:(-?\d+)?(:(-?\d+)?)?", text):
        start, stop, step = (int(p) if p else None for p in (text.split(":") + [""])[:3])
        if step == 0:
            raise CalibrationError(f"bad subset {spec!r}: slice step cannot be 0; accepted forms: {SUBSET_FORMS}")
        chosen = np.zeros(n_items, dtype=bool)
        chosen[index[slice(start, stop, step)]] = True
    else:
        raise CalibrationError(f"bad subset {spec!r}: accepted forms are {SUBSET_FORMS}")
    return chosen != negate
