"""Where arrays of every calibration sample live: in RAM up to a budget, then in files on disk.

``compress`` caches the tensors alive at the current cut for all calibration samples, for the pruned and the
original network. A ``Store`` hands out those arrays: plain numpy arrays while the RAM they hold stays within
its budget, past it a ``DiskArray``: a file in a temporary folder, unlinked as soon as it is open (nothing is
left behind after an error, Ctrl-C or a kill), read and written by ranges of samples with ``pread``/``pwrite``
so its pages sit in the kernel's cache rather than in the process's resident memory. The bytes are the same
either way: results do not depend on the budget.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from onnxprune.errors import OptionError, ResourceError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of ``4G``, ``512M``, ``1.5GB``, ``2048`` (powers of 1024)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size: use e.g. 4G, 512M or 1.5GB")
    return int(float(match[1]) * 1024 ** " kmgt".index((match[2] or " ").lower()))


def memory_bytes(value: int | str | None) -> int | None:
    """The ``memory`` option as bytes: a count, a size such as '4G', or None (the default budget)."""
    if value is None or isinstance(value, int):
        return value
    try:
        return parse_size(str(value))
    except ValueError as e:
        raise OptionError(f"memory {value!r}: {e}", option="memory") from None


def check_memory(value: object) -> None:
    """OptionError unless ``value`` is None or a whole number of bytes ≥ 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise OptionError(f"memory={value!r}: a number of bytes ≥ 0 (--memory 4G)", option="memory")


def available_memory() -> int:
    """Bytes of memory available to new allocations (MemAvailable), or the free pages where that is unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_budget() -> int:
    """Half of the memory available now: the rest is for onnxruntime, the statistics and everything else."""
    return available_memory() // 2


def show_bytes(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class DiskArray:
    """An array on disk whose first axis is the sample: ``a[i]``, ``a[start:stop(:step)]`` and ``a[indices]``
    read rows into a new numpy array, ``a[start:stop] = rows`` writes them."""

    def __init__(self, fd: int, shape: Sequence[int], dtype: np.dtype) -> None:
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self._fd = fd
        self._row = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        weakref.finalize(self, os.close, fd)

    @property
    def nbytes(self) -> int:
        return self._row * len(self)

    def __len__(self) -> int:
        return self.shape[0]

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        raise TypeError("a DiskArray is read by ranges of samples (a[start:stop]), never whole")

    def _rows(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((max(stop - start, 0), *self.shape[1:]), self.dtype)
        view, offset = memoryview(out.reshape(-1).view(np.uint8)), start * self._row
        while view.nbytes:
            n = os.preadv(self._fd, [view], offset)
            if n <= 0:
                raise OSError(f"short read from a spilled array at byte {offset}")
            view, offset = view[n:], offset + n
        return out

    def __getitem__(self, key: int | slice | Sequence[int] | np.ndarray) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            return self[np.array([key])][0]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step == 1:
                return self._rows(start, stop)
            key = np.arange(start, stop, step)
        rows = np.asarray(key, dtype=np.int64).reshape(-1)
        rows = np.where(rows < 0, rows + len(self), rows)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"sample index out of range for {len(self)} samples")
        out = np.empty((len(rows), *self.shape[1:]), self.dtype)
        if not rows.size:
            return out
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # one read per run of consecutive rows
        for a, b in zip([0, *breaks], [*breaks, len(rows)]):
            out[a:b] = self._rows(int(rows[a]), int(rows[a]) + b - a)
        return out

    def __setitem__(self, key: slice, value: np.ndarray) -> None:
        start, stop, step = key.indices(len(self)) if isinstance(key, slice) else (None, None, None)
        if step != 1:
            raise TypeError("a DiskArray is written by contiguous ranges of samples (a[start:stop] = rows)")
        data = np.ascontiguousarray(np.broadcast_to(value, (stop - start, *self.shape[1:])), dtype=self.dtype)
        view, offset = memoryview(data.reshape(-1).view(np.uint8)), start * self._row
        while view.nbytes:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n


Array = np.ndarray | DiskArray


class Store:
    """Hands out sample arrays: in RAM while their total stays within ``budget`` bytes (None: no limit), then
    ``DiskArray`` files in ``folder`` (default: the system's temporary folder)."""

    def __init__(self, budget: int | None = None, folder: str | Path | None = None) -> None:
        self.budget = budget
        self.folder = Path(folder or tempfile.gettempdir())
        self.in_ram = 0  # bytes of the store's live numpy arrays
        self.peak_ram = 0
        self.spilled = 0  # bytes written to disk so far (all arrays ever spilled)

    def check_room(self, n: int, need: int) -> None:
        """ResourceError before any work when ``n`` samples' cached tensors (``need`` bytes: the inputs, and at the
        widest cut, i.e. before any group's consumer, the live tensors of both networks; ``memory.plan``) cannot fit
        in the RAM budget plus the free space of the spill folder."""
        if self.budget is None or need <= self.budget:
            return
        if not self.folder.is_dir():
            raise ResourceError(f"the spill folder {self.folder} is not a folder: create it or point spill_dir at "
                                "another", option="spill_dir")
        free = shutil.disk_usage(self.folder).free
        if need > self.budget + free:
            raise ResourceError(
                f"{n} calibration samples need about {show_bytes(need)} of cached activations, and there are "
                f"{show_bytes(self.budget)} of RAM for them (the memory budget) and {show_bytes(free)} free "
                f"in {self.folder}: calibrate on fewer samples, raise the memory budget, free disk space "
                "there or point spill_dir elsewhere", option="spill_dir")

    def _free(self, nbytes: int) -> None:
        self.in_ram -= nbytes

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> Array:
        """An uninitialised array of ``shape`` (samples first)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if self.budget is None or self.in_ram + nbytes <= self.budget:
            array = np.empty(shape, dtype)
            self.in_ram += nbytes
            self.peak_ram = max(self.peak_ram, self.in_ram)
            weakref.finalize(array, self._free, nbytes)
            return array
        return self._disk(shape, dtype, nbytes)

    def _disk(self, shape: Sequence[int], dtype: np.dtype, nbytes: int) -> DiskArray:
        try:
            fd, path = tempfile.mkstemp(prefix="onnxprune-", suffix=".spill", dir=self.folder)
        except OSError as e:
            raise ResourceError(f"cannot spill cached activations to {self.folder} ({e.strerror}): point --spill-dir "
                                "at a writable folder", option="spill_dir") from None
        os.unlink(path)  # the open descriptor keeps the file until it is closed, whatever happens
        try:
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)  # no room is an error now, not a crash on a later write
        except OSError as e:
            os.close(fd)
            raise ResourceError(
                f"no room for {show_bytes(nbytes)} more of cached activations in {self.folder} ({e.strerror}; "
                f"{show_bytes(self.spilled)} spilled so far): free disk space there, point --spill-dir elsewhere, "
                "raise --memory or calibrate on fewer samples", option="spill_dir") from None
        self.spilled += nbytes
        return DiskArray(fd, shape, dtype)

    def stack(self, batches: Iterable[Mapping[str, np.ndarray]], n: int) -> dict[str, Array]:
        """The ``n`` samples of ``batches`` (name -> array with samples first), batch by batch into store
        arrays."""
        out: dict[str, Array] = {}
        start = 0
        for batch in batches:
            m = len(next(iter(batch.values())))
            for name, array in batch.items():
                if name not in out:
                    out[name] = self.empty((n, *array.shape[1:]), array.dtype)
                out[name][start : start + m] = array
            start += m
        if start != n:
            raise ValueError(f"the batches held {start} samples, {n} were announced")
        return out

    def copy(self, array: Array, rows: np.ndarray | None = None, chunk: int = 64) -> Array:
        """Rows ``rows`` (default: all) of ``array`` as a new store array, a range of samples at a time."""
        rows = np.arange(len(array)) if rows is None else np.asarray(rows)
        out = self.empty((len(rows), *array.shape[1:]), array.dtype)
        for start in range(0, len(rows), chunk):
            out[start : start + chunk] = array[rows[start : start + chunk]]
        return out

    def concat(self, arrays: Sequence[Array], chunk: int = 64) -> Array:
        """``np.concatenate(arrays)`` (along the samples) as a new store array, a range of samples at a time."""
        out = self.empty((sum(len(a) for a in arrays), *arrays[0].shape[1:]), arrays[0].dtype)
        start = 0
        for a in arrays:
            for s in range(0, len(a), chunk):
                piece = a[s : s + chunk]
                out[start + s : start + s + len(piece)] = piece
            start += len(a)
        return out

    def take(self, array: Array, index: np.ndarray, axis: int, chunk: int = 64) -> Array:
        """``np.take(array, index, axis)`` (``axis`` ≥ 1) as a new store array, a range of samples at a time."""
        shape = list(array.shape)
        shape[axis] = len(index)
        out = self.empty(shape, array.dtype)
        for start in range(0, len(array), chunk):
            out[start : start + chunk] = np.take(array[start : start + chunk], index, axis=axis)
        return out
