"""Synthetic text images for the OCR models of ``third_party.py``: a text detector, recogniser or direction
classifier calibrated on ImageNet photos sees almost no text, and its output on them is ~0 everywhere, so
neither the pruner nor the error measure would see what the model is for. A user calibrates on their own
domain; these pages and lines of random words (Pillow's bundled font, deterministic per seed) stand in for it.

    python benchmarks/text_images.py out/ --kind page --count 8     # a look at what they are
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

KINDS = {"page": (416, 416), "line": (64, 384), "table": (488, 488)}  # (height, width) before resize and crop
LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _words(rng: random.Random, count: int) -> str:
    return " ".join("".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 9))) for _ in range(count))


def _background(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    """A light, slightly uneven paper colour (a gradient between two random light tones)."""
    h, w = size
    a, b = (tuple(rng.randint(170, 255) for _ in range(3)) for _ in range(2))
    strip = Image.linear_gradient("L").resize((w, h))
    return Image.composite(Image.new("RGB", (w, h), a), Image.new("RGB", (w, h), b), strip)


def text_image(kind: str, seed: int) -> Image.Image:
    """One ``page`` (several lines at random sizes and places), ``line`` (one line filling the height) or
    ``table`` (a ruled grid of 2-8 rows and 2-5 columns, a word or two in most cells); every other line image is
    upside down, so a direction classifier sees both of its classes."""
    rng = random.Random(seed)
    h, w = KINDS[kind]
    image = _background(rng, (h, w))
    draw = ImageDraw.Draw(image)
    ink = tuple(rng.randint(0, 90) for _ in range(3))
    if kind == "table":
        return _table(rng, image, draw, ink)
    if kind == "line":
        font = ImageFont.load_default(size=rng.randint(int(h * 0.55), int(h * 0.8)))
        draw.text((rng.randint(2, 20), h // 2), _words(rng, 6), fill=ink, font=font, anchor="lm")
        return image.rotate(180) if seed % 2 else image
    y = rng.randint(4, 30)
    while y < h - 20:
        size = rng.randint(14, 40)
        font = ImageFont.load_default(size=size)
        draw.text((rng.randint(4, w // 3), y), _words(rng, rng.randint(1, 5)), fill=ink, font=font)
        y += int(size * rng.uniform(1.3, 2.5))
    return image


def _table(rng: random.Random, image: Image.Image, draw: ImageDraw.ImageDraw, ink: tuple[int, ...]) -> Image.Image:
    h, w = image.height, image.width
    rows, cols = rng.randint(2, 8), rng.randint(2, 5)
    top, left = rng.randint(10, 60), rng.randint(10, 40)
    bottom, right = h - rng.randint(10, 60), w - rng.randint(10, 40)
    ys = [top + (bottom - top) * i // rows for i in range(rows + 1)]
    xs = [left + (right - left) * j // cols for j in range(cols + 1)]
    for y in ys:
        draw.line([(left, y), (right, y)], fill=ink, width=rng.randint(1, 2))
    for x in xs:
        draw.line([(x, top), (x, bottom)], fill=ink, width=rng.randint(1, 2))
    size = max(10, min(24, (ys[1] - ys[0]) // 2))
    font = ImageFont.load_default(size=size)
    for i in range(rows):
        for j in range(cols):
            if rng.random() < 0.85:
                draw.text((xs[j] + 4, (ys[i] + ys[i + 1]) // 2), _words(rng, rng.randint(1, 2))[: max(3, (xs[j + 1] - xs[j]) // (size // 2 + 1))],
                          fill=ink, font=font, anchor="lm")
    return image


def write_text_images(folder: Path, kind: str, count: int, seed: int = 0) -> Path:
    """``count`` images of ``kind`` as ``text_NNNN.png`` (no leading class number: they carry no label)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        text_image(kind, seed + i).save(folder / f"text_{i:04d}.png")
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kind", choices=list(KINDS), default="page")
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_text_images(args.out, args.kind, args.count, args.seed))


if __name__ == "__main__":
    main()
