"""A detector's layers are fitted where its original sees objects: the weighted statistics equal the positions
repeated as often as they weigh, the object map puts each scoring anchor at its box centre's cell, the weights
follow each consumer's grid, and compress uses them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnxprune.core.statistics import grid_of, position_weights
from onnxprune.imitation.gram import ConsumerStats
from onnxprune.ops.registry import thin
from onnxprune.tasks import Detect, infer_task
from onnxprune.tasks.boxes import cells


def _sums(stats: ConsumerStats) -> list[np.ndarray]:
    return [stats.xx, stats.xt, stats.sx, stats.st, np.asarray(stats.tt), np.asarray(stats.count)]


@pytest.mark.parametrize("offset", [0.0, 50.0])  # 50: columns far from 0 (the shifted sums)
def test_weighted_statistics_equal_the_positions_repeated(offset: float) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(offset, 1.0, (2, 5, 7)).astype(np.float32)  # (B, D, L)
    t = rng.normal(offset, 1.0, (2, 3, 7)).astype(np.float32)
    w = rng.integers(0, 4, (2, 7))
    weighted, repeated = ConsumerStats(5, 3), ConsumerStats(5, 3)
    weighted.update(x, t, weight=torch.from_numpy(w.astype(np.float32)))
    rows = np.repeat(np.arange(14), w.ravel())
    xr, tr = x.transpose(0, 2, 1).reshape(14, 5)[rows], t.transpose(0, 2, 1).reshape(14, 3)[rows]
    repeated.update(xr, tr)
    for a, b in zip(_sums(weighted), _sums(repeated)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)
    assert weighted.rows is None  # the positions are not kept for weighted sums


def _yolo(hw: tuple[int, int] = (64, 64)) -> tuple[Detect, np.ndarray]:
    """A YOLOv8-style output (``[1, 4 + 2, anchors]``, boxes as centre and size) with every score 0.01 but three
    anchors': 0.9 and 0.6 for two boxes centred in cell (1, 2) of an 8-pixel grid, 0.3 for one in cell (5, 6)."""
    a = sum(cells(hw, (8, 16, 32)))
    y = np.zeros((1, 6, a), np.float32)
    y[0, :2] = 32.0
    y[0, 2:4] = 10.0
    y[0, 4:] = 0.01
    for anchor, (cx, cy), score in ((3, (20.0, 12.0), 0.9), (70, (23.0, 9.0), 0.6), (80, (52.0, 44.0), 0.3)):
        y[0, :4, anchor] = (cx, cy, 6.0, 6.0)
        y[0, 5, anchor] = score
    task = infer_task([y], hw, 1)
    assert isinstance(task, Detect)
    return task, y


def test_the_object_map_places_each_scoring_anchor_at_its_box_centre() -> None:
    task, y = _yolo()
    found = task.object_map([y], 8)
    expected = np.zeros((1, 8, 8), np.float32)
    expected[0, 1, 2], expected[0, 5, 6] = 0.9, 0.3  # the best of the two in one cell; 0.01 is no object
    np.testing.assert_allclose(found, expected, rtol=1e-6)


def test_position_weights_follow_each_consumers_grid() -> None:
    assert grid_of(64, (8, 8)) == (8, 8) and grid_of(256, (8, 8)) == (16, 16) and grid_of(1, (8, 8)) == (1, 1)
    assert grid_of(32, (4, 8)) == (4, 8) and grid_of(197, (8, 8)) is None and grid_of(8, (8, 8)) is None
    maps = np.arange(2 * 4 * 4, dtype=np.float32).reshape(2, 4, 4)
    coarse = position_weights(maps, (2, 2), 1, 0)
    np.testing.assert_allclose(coarse[0], [2.5, 4.5, 10.5, 12.5])  # each the mean of its 2x2 cells
    fine = position_weights(maps, (8, 8), 1, 0)
    assert fine.shape == (2, 64) and fine[1, 8 * 7 + 7] == maps[1, 3, 3] and fine[0, 1] == maps[0, 0, 0]
    kept = position_weights(maps, (4, 4), 3, 1)  # every third position across the two samples, from the second
    np.testing.assert_array_equal(kept, thin(torch.from_numpy(maps.reshape(2, 1, 16)), 3, 1)[:, 0])


def test_a_detector_is_fitted_where_its_original_sees_objects(tmp_path, monkeypatch) -> None:
    """Compress computes weights for the tiny YOLO (1 plus the object map over its mean, on an 8-pixel grid) and
    its layers' statistics use them: without them the pruned model differs."""
    import onnxprune
    from models.build import Spec, export_model, randomise
    from models.yolo import Detector
    from onnxprune.pipeline import compressor

    spec = Spec(lambda: Detector(classes=2, w=4), (1, 3, 64, 64), "images", "output0")
    model = randomise(spec.factory(), input_shape=spec.input_shape)
    path = export_model(model, tmp_path / "yolo.onnx", spec=spec)
    calib = np.random.default_rng(0).random((12, *spec.input_shape[1:]), dtype=np.float32)
    seen = []
    real = compressor.object_weights
    monkeypatch.setattr(compressor, "object_weights", lambda maps: seen.append(real(maps)) or seen[-1])
    weighted = onnxprune.compress(str(path), calib, budget=onnxprune.Ratio(0.7)).model
    (weights,) = seen
    assert weights.shape == (12, 8, 8) and weights.min() >= 1.0
    np.testing.assert_allclose(weights.mean(), 2.0, rtol=1e-5)
    monkeypatch.setattr(compressor, "object_weights", lambda maps: None)
    plain = onnxprune.compress(str(path), calib, budget=onnxprune.Ratio(0.7)).model
    differ = [a.name for a, b in zip(weighted.graph.initializer, plain.graph.initializer)
              if a.raw_data != b.raw_data]
    assert differ
