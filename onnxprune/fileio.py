"""Writing output files atomically: a failure never leaves a half file, and never overwrites the input."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx

from onnxprune.errors import ModelError, OutputError
from onnxprune.ir.ort import make_session, ort_failure


def check_output(out_path: Path, refuse: Iterable[Path] = (), what: str = "output") -> Path:
    """OutputError unless ``out_path`` can be written: not an input in ``refuse``, not a folder, in an
    existing folder this process may write to. Commands call it for every output before any work."""
    out_path = Path(out_path)
    for src in refuse:
        if out_path.resolve() == Path(src).resolve():
            raise OutputError(f"{out_path}: the {what} would overwrite the input: choose another path")
    if out_path.is_dir():
        raise OutputError(f"{out_path} is a directory: give a file path for the {what}")
    if not out_path.parent.is_dir():
        raise OutputError(f"{out_path}: the folder {out_path.parent} of the {what} does not exist: create it first")
    if not os.access(out_path.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{out_path}: the folder {out_path.parent} of the {what} is not writable: "
                          "choose another path")
    return out_path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(out_path: Path, write, refuse: Iterable[Path] = ()) -> Path:
    """Call ``write(tmp_path)`` then move the result onto ``out_path``; never onto a path in ``refuse``.
    The file gets the permissions of any file the user creates (0666 less the umask)."""
    out_path = check_output(out_path, refuse)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out_path


def save_model(model: onnx.ModelProto, out_path: Path, refuse: Iterable[Path] = (),
               sample: Mapping[str, np.ndarray] | None = None) -> Path:
    """Write ``model`` to ``out_path`` atomically (see ``atomic_write``). With ``sample`` (one input per name), the
    written file is first loaded by onnxruntime and run on it: a model that fails is not written (ModelError
    naming the node onnxruntime names)."""
    def write(tmp: Path) -> None:
        onnx.save(model, str(tmp))
        if sample is not None:
            check_runs(tmp, sample, out_path)

    return atomic_write(out_path, write, refuse=refuse)


def check_runs(path: Path, sample: Mapping[str, np.ndarray], shown: Path | None = None) -> None:
    """ModelError unless onnxruntime loads the model at ``path`` and runs it on ``sample``; the message names
    ``shown`` (the path the user asked for) and the node onnxruntime reports."""
    try:
        session, _ = make_session(str(path), "cpu", arena=False, quiet=True)
        batch = {i.name: i.shape[0] for i in session.get_inputs() if i.shape and isinstance(i.shape[0], int)}
        session.run(None, {k: np.repeat(v[:1], batch.get(k, 1), axis=0) for k, v in sample.items()})
    except Exception as exc:  # noqa: BLE001 - onnxruntime's errors are plain RuntimeErrors of many kinds
        node, text = ort_failure(exc)
        where = f"node {node}" if node else "a node onnxruntime does not name"
        raise ModelError(f"{shown or path}: not written: the pruned model fails in onnxruntime at {where} on one "
                         f"calibration sample ({text}); this is a bug in onnxprune: please report it with the "
                         "model") from exc
