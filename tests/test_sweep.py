"""``sweep``: budgets share one calibration and one set of probes, and each model equals ``compress``'s at the same
budget; ``keep`` returns the cheapest judged budget at or above its floor and refuses one no budget keeps."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from PIL import Image

import onnxprune.strategies.allocators as allocators
from onnxprune import api
from onnxprune.errors import TargetError
from onnxprune.strategies import Ratio
from onnxprune.flags.parse import parse_target
from onnxprune.sweep import sweep


def _digest(model: onnx.ModelProto) -> str:
    h = hashlib.sha256()
    for t in sorted(model.graph.initializer, key=lambda t: t.name):
        h.update(numpy_helper.to_array(t).tobytes())
    return h.hexdigest()


@pytest.fixture()
def photos(tmp_path: Path) -> Path:
    return _noise_photos(tmp_path / "photos", 40, seed=0)


def _noise_photos(folder: Path, n: int, seed: int) -> Path:
    """``n`` random 40×48 images in ``folder`` (created)."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"{i:03d}_x.png")
    return folder


def test_a_sweep_probes_once_and_its_models_are_compress_s(tiny, photos: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    probed = []
    real = allocators.output_curves
    monkeypatch.setattr(allocators, "output_curves", lambda *a, **k: (probed.append(1), real(*a, **k))[1])
    result = sweep(tiny.path, photos, {"0.7": Ratio(0.7), "0.5": Ratio(0.5)}, tmp_path / "out", bench=False)
    assert len(probed) == 1  # the second budget reused the first one's probes
    assert [r.target for r in result.rows] == ["0.7", "0.5"] and result.rows[0].macs > result.rows[1].macs
    assert all(r.metric == "agreement" and 0 <= r.fidelity <= 1 for r in result.rows)
    assert result.held.endswith("(0%5)")
    alone = api.compress(tiny.path, photos, budget=Ratio(0.7), subset="!0%5")
    assert _digest(onnx.load(result.rows[0].path)) == _digest(alone.model)
    assert (tmp_path / "out/sweep.json").is_file()
    assert (tmp_path / "out/sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_keep_returns_the_cheapest_budget_above_its_floor(tiny, photos: Path, tmp_path: Path) -> None:
    result = sweep(tiny.path, photos, {"0.7": Ratio(0.7), "0.5": Ratio(0.5)}, tmp_path / "out", keep=0.0, bench=False)
    assert result.keep == {"floor": 0.0, "chosen": "0.5", "judged": 2, "metric": "agreement"}
    with pytest.raises(TargetError, match=r"no budget keeps agreement ≥ 2 on the held-out images \(less its spread "
                                          r"over them\): the mildest judged \(0.7, 0.\d+× MACs\) reaches [0-9.]+ ± "):
        sweep(tiny.path, photos, {"0.7": Ratio(0.7)}, tmp_path / "out2", keep=2.0, bench=False)


def test_keep_judges_a_budget_by_its_metric_less_its_spread(tiny, photos: Path, tmp_path: Path) -> None:
    row = sweep(tiny.path, photos, {"0.7": Ratio(0.7)}, tmp_path / "out", keep=0.0, bench=False).rows[0]
    assert row.spread > 0 and row.lower == pytest.approx(row.fidelity - row.spread)
    with pytest.raises(TargetError, match="no budget keeps"):  # the metric clears this floor, its lower bound not
        sweep(tiny.path, photos, {"0.7": Ratio(0.7)}, tmp_path / "out2", keep=row.fidelity - row.spread / 2,
              bench=False)


def test_keep_searches_milder_budgets_before_refusing(tiny, photos: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxprune.sweep as sweeping

    scores = iter([0.5, 1.0, 0.5, 0.5])  # 0.9 misses the floor, 0.95 keeps it, the (at most two) between miss it
    monkeypatch.setattr(sweeping, "fidelity", lambda result: ("scripted", next(scores)))
    result = sweep(tiny.path, photos, {}, tmp_path / "out", keep=0.9, bench=False)
    targets = {r.target for r in result.rows}
    assert result.keep["chosen"] == "0.95" and "0.9" in targets and "0.8" not in targets and "0.975" not in targets


def test_an_int8_sweep_judges_every_budget_s_int8_model_and_keeps_by_it(tiny, photos: Path, tmp_path: Path) -> None:
    from onnxprune.deploy.quantize import QuantizeOptions

    int8 = QuantizeOptions(methods=("minmax",), float_ends="no", samples=8)
    result = sweep(tiny.path, photos, {"0.7": Ratio(0.7)}, tmp_path / "out", keep=0.0, int8=int8, bench=True)
    row = result.rows[0]
    assert row.written is row.int8 and row.int8.path == str(tmp_path / "out/0.7.int8.onnx")
    assert any(n.op_type == "DequantizeLinear" for n in onnx.load(row.int8.path).graph.node)
    assert row.int8.fidelity is not None and row.int8.speedup > 0 and row.int8.macs == row.macs
    assert __import__("json").loads((tmp_path / "out/sweep.json").read_text())["rows"][0]["int8"]["path"] == row.int8.path


def test_targets_are_read_as_compress_reads_them() -> None:
    assert parse_target("0.8")[1] == Ratio(0.8)
    assert parse_target("245M")[1].count == 245e6
    assert parse_target("3.5ms")[1].ms == 3.5 and parse_target("0.8x")[1].ratio == 0.8
    with pytest.raises(TargetError, match="not a MAC ratio"):
        parse_target("fast")


def test_the_sweep_command_prints_the_trade_off(tiny, photos: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from onnxprune.cli import app

    result = CliRunner().invoke(app, ["sweep", str(tiny.path), "--calib", str(photos), "--targets", "0.7,0.5",
                                      "-o", str(tmp_path / "out"), "--keep", "0", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "speed-up" in result.output and "0.5 (--keep)" in result.output
    assert re.search(r"--keep 0: the cheapest budget keeping agreement less its spread is 0.5 \(0.\d\d× MACs, "
                     r"[0-9.]+ ± [0-9.]+, at least [0-9.-]+; 2 budgets judged\)", result.output.replace("\n", " "))
    rows = __import__("json").loads((tmp_path / "out/sweep.json").read_text())["rows"]
    assert all(r["speedup"] > 0 and r["latency_ms"] > 0 for r in rows)


def test_a_classifier_s_sweep_calibrates_on_the_mirrors_unless_told_not_to(tiny, photos: Path, tmp_path: Path
                                                                            ) -> None:
    """As compress: a classifier's calibration images come with their mirrors, ``--no-flip`` leaves them out."""
    from typer.testing import CliRunner

    from onnxprune.cli import app

    counts = []
    for flags in ([], ["--no-flip"]):
        out = tmp_path / f"out{len(flags)}"
        result = CliRunner().invoke(app, ["sweep", str(tiny.path), "--calib", str(photos), "--targets", "0.7", "-o",
                                          str(out), "--no-bench", "--quiet", *flags])
        assert result.exit_code == 0, result.output
        counts.append(__import__("json").loads((out / "0.7.json").read_text())["calibration_samples"])
    assert counts[0] == 2 * counts[1] > 0


def test_compress_keep_writes_the_cheapest_budget_that_keeps_the_floor(tiny, photos: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from onnxprune.cli import app

    out = tmp_path / "kept.onnx"
    result = CliRunner().invoke(app, ["compress", str(tiny.path), "--calib", str(photos), "-o", str(out), "--keep",
                                      "0", "--report", str(tmp_path / "r.json"), "--quiet"])
    assert result.exit_code == 0, result.output
    report = __import__("json").loads((tmp_path / "r.json").read_text())
    assert report["keep"]["chosen"] == "0.5" and report["keep"]["judged"] == 5 and report["keep"]["floor"] == 0
    assert _digest(onnx.load(out)) == _digest(onnx.load(tmp_path / "kept.sweep/0.5.onnx"))
    refused = CliRunner().invoke(app, ["compress", str(tiny.path), "--calib", str(photos), "-o", str(out), "--keep",
                                       "0.9", "--target-ratio", "0.5"])
    assert refused.exit_code == 2 and "--keep chooses the budget itself" in refused.output


def test_a_refused_sweep_leaves_nothing_behind(tiny, tmp_path: Path) -> None:
    from onnxprune.errors import CalibrationError

    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="no images in"):
        sweep(tiny.path, tmp_path / "empty", {"0.7": Ratio(0.7)}, tmp_path / "out", bench=False)
    assert not (tmp_path / "out").exists()


def test_a_detector_sweep_counts_the_probe_samples_with_objects(photos: Path, tmp_path: Path) -> None:
    """The shared probes' count of samples on which the original finds an object is the one compress reports."""
    from tests.test_heads import _nms_free

    _nms_free(tmp_path / "e2e.onnx")
    result = sweep(tmp_path / "e2e.onnx", photos, {"0.7": Ratio(0.7)}, tmp_path / "out", bench=False)
    alone = api.compress(tmp_path / "e2e.onnx", photos, budget=Ratio(0.7), subset="!0%5").report.allocation
    assert alone["task"] == "detect" and result.objects == (alone["with_objects"], alone["probe_samples"])


def test_a_detector_sweep_reports_the_samples_with_objects_each_run_kept(tmp_path: Path, capsys) -> None:
    """Past 32 calibration images each run keeps the samples with objects as compress does: the sweep reports and
    prints compress's count of them, not the shared probes'."""
    from onnxprune.tables import print_sweep
    from tests.test_heads import _nms_free

    many = _noise_photos(tmp_path / "many", 50, seed=1)
    _nms_free(tmp_path / "e2e.onnx")
    result = sweep(tmp_path / "e2e.onnx", many, {"0.7": Ratio(0.7)}, tmp_path / "out", bench=False)
    alone = api.compress(tmp_path / "e2e.onnx", many, budget=Ratio(0.7), subset="!0%5").report
    assert alone.objects is not None and alone.objects["samples"] == 40 and result.kept == alone.objects
    print_sweep(result, tmp_path / "out")
    printed = " ".join(capsys.readouterr().out.split())
    assert "40 calibration samples" in printed and "calibration samples the probes looked at" not in printed


def test_compress_keep_int8_writes_the_chosen_budget_s_int8_model(tiny, photos: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from onnxprune.cli import app

    out = tmp_path / "kept.onnx"
    result = CliRunner().invoke(app, ["compress", str(tiny.path), "--calib", str(photos), "-o", str(out), "--keep",
                                      "0", "--int8", "--report", str(tmp_path / "r.json"), "--quiet"])
    assert result.exit_code == 0, result.output
    report = __import__("json").loads((tmp_path / "r.json").read_text())
    chosen = report["keep"]["chosen"]
    assert report["keep"]["int8"] and report["keep"]["lower"] <= report["keep"]["reached"]
    written = onnx.load(str(tmp_path / "kept.int8.onnx"))
    assert any(n.op_type == "DequantizeLinear" for n in written.graph.node)
    assert _digest(written) == _digest(onnx.load(str(tmp_path / f"kept.sweep/{chosen}.int8.onnx")))
