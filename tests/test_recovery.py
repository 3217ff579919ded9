"""Few-shot recovery (`onnxprune recover`) on the tiny MobileNetV2-like model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxprune.analysis.graph import import_graph
from onnxprune.calib.sources import ArraySet, load_calibration
from onnxprune.compress import CompressOptions, compress
from onnxprune.errors import CalibrationError, ModelError
from onnxprune.recovery import RecoverOptions, recover, split
from onnxprune.recovery.segments import find_segments
from onnxprune.runtime.ort import model_input_specs
from tests.onnx_builders import run

FAST = {"steps": 100, "batch_size": 16, "provider": "cpu"}


@pytest.fixture(scope="module")
def student(tiny) -> onnx.ModelProto:
    """The tiny model at 50% of its MACs, channels and fold from local imitation, no refit: plenty to recover."""
    options = CompressOptions(target_ratio=0.5, method="local", reconstruct="none", provider="cpu", round_to=1)
    return compress(tiny.model, load_calibration(str(tiny.calib), model_input_specs(tiny.model)), options)[0]


def _calib(tiny, n: int | None = None):
    """The 64 calibration samples, or the first ``n``."""
    if n is None:
        return load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    name = tiny.model.graph.input[0].name
    return ArraySet({name: tiny.x}, np.arange(n), {name: np.dtype(np.float32)})


def test_segments_chain_from_input_to_output(tiny, student) -> None:
    segments = find_segments(import_graph(student), import_graph(tiny.model))
    assert segments[0].start == [i.name for i in student.graph.input]
    assert segments[-1].end == [o.name for o in student.graph.output]
    for a, b in zip(segments, segments[1:]):
        assert a.end == b.start
    assert sum(s.trainable for s in segments) >= 2
    nodes = [n for s in segments for n in s.nodes]
    assert len(nodes) == len(set(nodes)) == len(import_graph(student).nodes)


def test_recovery_lowers_held_out_loss_and_writes_back_exactly(tiny, student) -> None:
    model, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**FAST))
    assert report.improved and report.after < 0.9 * report.before
    assert all(s.held_after <= s.held_before for s in report.segments)
    assert report.writeback_error <= 1e-5
    assert report.samples_train + report.samples_held == len(tiny.x)
    onnx.checker.check_model(model)
    # the same nodes, new initializer values
    assert [n.name for n in model.graph.node] == [n.name for n in import_graph(student).nodes]
    held = tiny.x[split(len(tiny.x), 0.2)[1]]
    t = run(tiny.model, input=held)[0]
    before, after = run(student, input=held)[0], run(model, input=held)[0]
    assert np.linalg.norm(after - t) < np.linalg.norm(before - t)


@pytest.mark.parametrize("lr", [0.0, 50.0])
def test_never_worse_returns_the_input(tiny, student, lr: float) -> None:
    """No training (lr 0) or destructive training (lr 50): the held-out check hands back the input."""
    model, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**{**FAST, "lr": lr}))
    assert not report.improved
    assert model is student
    assert all(s.best_step == 0 for s in report.segments)


def test_bad_inputs(tiny, zoo, student) -> None:
    with pytest.raises(ModelError, match="outputs|inputs"):
        recover(student, zoo.model("mobilenet_v2"), _calib(tiny), RecoverOptions(**FAST))
    with pytest.raises(ModelError, match="nothing to recover"):
        recover(tiny.model, tiny.model, _calib(tiny), RecoverOptions(**FAST))
    renamed = onnx.ModelProto()
    renamed.CopyFrom(student)
    renamed.graph.node[3].name = "not_from_the_teacher"
    with pytest.raises(ModelError, match="not in the teacher"):
        recover(renamed, tiny.model, _calib(tiny), RecoverOptions(**FAST))
    with pytest.raises(CalibrationError, match="too few"):
        recover(student, tiny.model, _calib(tiny, 4), RecoverOptions(**FAST))
    with pytest.raises(CalibrationError, match="empty"):
        recover(student, tiny.model, _calib(tiny, 0), RecoverOptions(**FAST))
