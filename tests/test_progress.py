"""Progress without a terminal: plain lines on each new step and at least every interval while a step runs."""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from onnxprune import Ratio, api, progress
from onnxprune.cli import app
from onnxprune.progress import Heartbeat, clock_text

runner = CliRunner()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_on_new_steps_at_most_every_min_gap_and_an_estimate_per_phase() -> None:
    clock, out = Clock(), io.StringIO()
    beat = Heartbeat("compress", out, interval=10.0, min_gap=2.0, clock=clock)
    beat.update(0, 4, "probing a")  # within min_gap of the start: not written (a quick refusal prints no line)
    clock.now += 1.0
    beat.update(1, 4, "probing b")  # within min_gap of the last line: not written
    clock.now += 2.0
    beat.update(2, 4, "probing c: 3/8 samples")
    clock.now += 0.5
    beat.update(2, 4, "probing c: 8/8 samples")  # the same step: not a new line
    clock.now += 5.5
    beat.update(0, 4, "pruning a")  # a new phase: its estimate starts again
    lines = out.getvalue().splitlines()
    assert lines == ["[compress 0:03] probing c: 3/8 samples (2/4) · about 0:03 left in this phase",
                     "[compress 0:09] pruning a (0/4)"]
    clock.now += 4.0
    beat.update(1, 4, "pruning b")
    assert out.getvalue().splitlines()[-1] == "[compress 0:13] pruning b (1/4) · about 0:12 left in this phase"


def test_beat_repeats_the_line_after_the_interval_only() -> None:
    clock, out = Clock(), io.StringIO()
    beat = Heartbeat("recover", out, interval=10.0, clock=clock)
    beat.update(3, 10, "segment 2")
    clock.now += 9.0
    beat.beat()
    assert not out.getvalue()
    clock.now += 1.0
    beat.beat()
    assert out.getvalue().splitlines()[-1] == "[recover 0:10] segment 2 (3/10) · about 0:23 left in this phase"


def test_the_thread_writes_while_a_step_runs_long_and_a_last_line() -> None:
    out = io.StringIO()
    with Heartbeat("compress", out, interval=0.05) as beat:
        beat.update(1, 3, "pruning x")
        time.sleep(0.5)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 5 and all("pruning x (1/3)" in line for line in lines[:-1])
    assert lines[-1].endswith("] done")


def test_clock_text() -> None:
    assert [clock_text(s) for s in (0, 59.6, 61, 3725)] == ["0:00", "1:00", "1:01", "1:02:05"]


def test_compress_without_a_terminal_prints_progress_lines_and_quiet_none(tiny, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "MIN_GAP", 0.0)
    argv = ["compress", str(tiny.path), "--calib", str(tiny.calib), "--target-ratio", "0.6"]
    result = runner.invoke(app, [*argv, "-o", str(tmp_path / "a.onnx")])
    assert result.exit_code == 0, result.stderr
    lines = result.stderr.splitlines()
    assert any(line.startswith("[compress ") and "probing" in line for line in lines)
    assert any(line.startswith("[compress ") and "pruning" in line for line in lines)
    assert lines[-1].startswith("[compress ") and lines[-1].endswith("] done")
    quiet = runner.invoke(app, [*argv, "-o", str(tmp_path / "b.onnx"), "--quiet"])
    assert quiet.exit_code == 0, quiet.stderr
    assert quiet.stderr == ""


def test_compress_says_what_it_does_before_the_first_group(tiny) -> None:
    """Loading, reading the samples and analysing a large export take seconds each: the progress names them (a
    log showed 21 s of "starting" on a 640² detector)."""
    labels: list[str] = []
    api.compress(tiny.model, str(tiny.calib), budget=Ratio(0.6), on_layer=lambda i, total, label: labels.append(label))
    assert labels[:3] == ["loading the model", "reading the calibration samples", "analysing the graph"]
