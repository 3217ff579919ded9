"""Cached activations in bounded memory: ``ir.store`` spills past its budget to unlinked files, and
``compress`` gives the same model whatever the budget."""

from __future__ import annotations

import errno
import os

import numpy as np
import onnx
import pytest

from onnxprune.calib.sources import load_calibration
from onnxprune.errors import OptionError, ResourceError, TargetError
from onnxprune.pipeline import compress
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.store import DiskArray, Store, memory_bytes, parse_size
from onnxprune.strategies import MACs, Ratio, options_from


def test_sizes_parse_in_powers_of_1024() -> None:
    assert [parse_size(t) for t in ("2048", "4G", "512M", "1.5GB", "3k")] == [2048, 4 * 2**30, 512 * 2**20,
                                                                           3 * 2**30 // 2, 3072]
    assert memory_bytes(None) is None and memory_bytes(5) == 5
    with pytest.raises(OptionError, match="'lots' is not a size"):
        memory_bytes("lots")


def test_a_disk_array_reads_and_writes_ranges_of_samples(tmp_path) -> None:
    store = Store(budget=0, folder=tmp_path)
    a = store.empty((10, 3, 2), np.float32)
    assert isinstance(a, DiskArray) and (len(a), a.shape, a.dtype, a.nbytes) == (10, (10, 3, 2), np.float32, 240)
    assert list(tmp_path.iterdir()) == []  # unlinked as soon as it is open
    want = np.arange(60, dtype=np.float32).reshape(10, 3, 2)
    a[0:4], a[4:10] = want[0:4], want[4:10]
    np.testing.assert_array_equal(a[:], want)
    np.testing.assert_array_equal(a[2:7], want[2:7])
    np.testing.assert_array_equal(a[::3], want[::3])
    np.testing.assert_array_equal(a[np.array([9, 0, 4])], want[[9, 0, 4]])
    np.testing.assert_array_equal(a[np.array([3, 4, 5, 8, -1])], want[[3, 4, 5, 8, -1]])
    assert a[np.array([], dtype=np.int64)].shape == (0, 3, 2)
    with pytest.raises(IndexError):
        a[10]
    np.testing.assert_array_equal(a[-1], want[-1])
    np.testing.assert_array_equal(store.take(a, np.array([2, 0]), axis=1, chunk=3)[:], np.take(want, [2, 0], 1))
    np.testing.assert_array_equal(store.copy(a, np.array([7, 1]))[:], want[[7, 1]])
    np.testing.assert_array_equal(store.concat([a, want[:5]], chunk=4)[:], np.concatenate([want, want[:5]]))
    np.testing.assert_array_equal(store.stack(({"x": want[s : s + 3]} for s in range(0, 10, 3)), 10)["x"][:], want)
    with pytest.raises(TypeError, match="by ranges"):
        np.asarray(a)
    with pytest.raises(TypeError, match="contiguous ranges"):
        a[::2] = want[::2]


def test_arrays_stay_in_ram_within_the_budget_and_free_it(tmp_path) -> None:
    store = Store(budget=1000, folder=tmp_path)
    a = store.empty((100,), np.float64)  # 800 bytes
    b = store.empty((100,), np.float64)  # would make 1600: on disk
    assert isinstance(a, np.ndarray) and isinstance(b, DiskArray)
    assert (store.in_ram, store.spilled) == (800, 800)
    del a
    assert store.in_ram == 0 and isinstance(store.empty((100,), np.float64), np.ndarray)


def test_no_room_on_disk_is_one_clear_error(tmp_path, monkeypatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ResourceError, match=r"no room for .* in .*free disk space there, point --spill-dir"):
        Store(budget=0, folder=tmp_path).empty((1000, 10), np.float32)
    assert list(tmp_path.iterdir()) == []


def _compress(tiny, **options):
    calib = load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    return compress(tiny.model, calib, options_from(Ratio(0.6), provider="cpu", **options))


def test_the_pruned_model_does_not_depend_on_the_memory_budget(tiny, tmp_path) -> None:
    """Every cached tensor on disk (budget 0) or in RAM: the same bytes in, the same model out, bit for bit."""
    in_ram, _ = _compress(tiny, memory=2**40)
    on_disk, report = _compress(tiny, memory=0, spill_dir=str(tmp_path))
    assert report.layers
    weights = lambda m: {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}  # noqa: E731
    assert weights(on_disk) == weights(in_ram)
    assert list(tmp_path.iterdir()) == []


def test_global_imitation_reads_its_cut_tensors_from_the_spill_files_too(tiny, tmp_path) -> None:
    from onnxprune.strategies import Global

    in_ram, _ = _compress(tiny, select=Global(), memory=2**40)
    on_disk, _ = _compress(tiny, select=Global(), memory=0, spill_dir=str(tmp_path))
    weights = lambda m: {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}  # noqa: E731
    assert weights(on_disk) == weights(in_ram)


def test_nothing_is_left_in_the_spill_folder_after_an_error_or_an_interrupt(tiny, tmp_path) -> None:
    """The calibration set is spilled before the budget is checked: an unreachable one raises with files open."""
    calib = load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    with pytest.raises(TargetError):
        compress(tiny.model, calib, options_from(MACs(1), provider="cpu", memory=0, spill_dir=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []

    def interrupt(i: int, total: int, label: str) -> None:
        if i == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compress(tiny.model, calib, options_from(Ratio(0.6), provider="cpu", memory=0, spill_dir=str(tmp_path)),
                 on_layer=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(OptionError, match="memory=-1"):
        options_from(Ratio(0.6), memory=-1)


def test_a_calibration_set_that_cannot_fit_fails_before_any_work(tiny, tmp_path, monkeypatch) -> None:
    """No RAM for activations and a full spill folder: one error naming the sizes and the ways out, raised before
    a single sample is read."""
    import shutil
    from collections import namedtuple

    from onnxprune.calib.sources import CalibrationSet

    class Untouched(CalibrationSet):
        input_names = ["input"]

        def __len__(self) -> int:
            return 64

        def batches(self, batch_size: int):
            raise AssertionError("the samples were read before the room was checked")

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 10**5, 10**5))
    with pytest.raises(ResourceError, match=r"64 calibration samples need about .* free in .*fewer samples"):
        compress(tiny.model, Untouched(), options_from(Ratio(0.6), provider="cpu", memory=0, spill_dir=str(tmp_path)))
    monkeypatch.undo()
    with pytest.raises(ResourceError, match="spill folder .*missing is not a folder"):
        compress(tiny.model, Untouched(), options_from(Ratio(0.6), provider="cpu", memory=0,
                                                       spill_dir=str(tmp_path / "missing")))
    calib = load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    _, report = compress(tiny.model, calib, options_from(Ratio(0.6), provider="cpu", memory=0,
                                                         spill_dir=str(tmp_path)))
    assert report.layers  # with the disk's real free space it fits


def test_progress_counts_the_samples_pushed_to_each_cut(tiny) -> None:
    """A long run on a big set stays visibly alive: within each group, the samples brought to its cut so far."""
    labels: list[tuple[int, str]] = []
    calib = load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    _, report = compress(tiny.model, calib, options_from(Ratio(0.6), provider="cpu", batch_size=16),
                         on_layer=lambda i, total, label: labels.append((i, label)))
    counted = [(i, label) for i, label in labels if label.endswith(" samples")]
    assert {f"{k}/64 samples" for k in (16, 32, 48, 64)} <= {label.rsplit(": ", 1)[1] for _, label in counted}
    assert report.layers and any(i == 0 and label.endswith(": 64/64 samples") for i, label in counted)
