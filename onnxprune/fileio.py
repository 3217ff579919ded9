"""Writing output files atomically: a failure never leaves a half file, and never overwrites the input."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from onnxprune.errors import OutputError


def atomic_write(out_path: Path, write, refuse: Iterable[Path] = ()) -> Path:
    """Call ``write(tmp_path)`` then move the result onto ``out_path``; never onto a path in ``refuse``."""
    out_path = Path(out_path)
    for src in refuse:
        if out_path.resolve() == Path(src).resolve():
            raise OutputError(f"{out_path}: the output would overwrite the input: choose another output path")
    if out_path.is_dir():
        raise OutputError(f"{out_path} is a directory: give a file path for the output")
    if not out_path.parent.is_dir():
        raise OutputError(f"{out_path}: the folder {out_path.parent} does not exist: create it first")
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path
