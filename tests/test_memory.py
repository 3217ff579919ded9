"""Memory held in every phase: the statistics unfold a few samples at a time within the plan's bytes (with the same
result up to float rounding), and the plan fits the store's budget, onnxruntime's batch and the statistics chunk to the memory available,
saying what it lowered; the report records the plan and the peak RSS."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import onnxprune
from onnxprune.analysis import analyze, consumers
from onnxprune.pipeline.memory import MIN_STATS_BYTES, RUN_BYTES, peak_rss, plan
from onnxprune.ir.cuts import Liveness
from tests.onnx_builders import export_torch

from models.unet import UNet


@pytest.fixture(scope="module")
def unet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-level U-Net at 128x128: a 3x3 conv over 16 channels unfolds to 9.4 MB a sample (its inputs) and twice
    that with the original's and the target: 8 samples of it, the old chunk, are 160 MB."""
    torch.manual_seed(0)
    return export_torch(UNet(classes=1, widths=(16, 32)), tmp_path_factory.mktemp("unet") / "unet.onnx", (1, 3, 128, 128))


def _weights(model: onnx.ModelProto) -> list[np.ndarray]:
    return [onnx.numpy_helper.to_array(t) for t in sorted(model.graph.initializer, key=lambda t: t.name)]


def test_statistics_unfold_within_the_plan_and_give_the_same_model(unet: Path, monkeypatch) -> None:
    calib = np.random.default_rng(0).standard_normal((16, 3, 128, 128)).astype(np.float32)
    largest = [0]
    unfold = consumers.unfold

    def spy(node, x):
        cols = unfold(node, x)
        largest[0] = max(largest[0], cols.numel() * 4)
        return cols

    monkeypatch.setattr(consumers, "unfold", spy)
    free = onnxprune.compress(str(unet), calib, budget=onnxprune.Ratio(0.7))
    roomy = largest[0]
    largest[0] = 0
    tight = onnxprune.compress(str(unet), calib, budget=onnxprune.Ratio(0.7), memory="1M")
    assert tight.report.memory["stats_bytes"] == MIN_STATS_BYTES
    assert roomy > MIN_STATS_BYTES and largest[0] <= MIN_STATS_BYTES // 2  # one of the three unfolds of a chunk
    for a, b in zip(_weights(tight.model), _weights(free.model), strict=True):  # the same up to float rounding
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5 * max(1.0, float(np.abs(b).max())))
    assert tight.report.memory["peak_rss"] > 0 and tight.report.memory["budget"] == 1 << 20


def test_the_plan_lowers_what_it_must_to_fit_and_says_so(unet: Path) -> None:
    model = onnxprune.load(str(unet))
    analysis = analyze(model)
    live = Liveness(analysis.graph)
    roomy = plan(analysis, live, 500, 32, False, None, available=lambda: 64 << 30)
    assert roomy.actions == [] and roomy.budget == 32 << 30 and roomy.run_batch == 32
    tight = plan(analysis, live, 500, 32, False, None, available=lambda: 256 << 20)
    assert tight.estimate <= 0.85 * (256 << 20) or tight.run_batch == 1
    assert tight.budget < roomy.budget and tight.run_batch < 32
    assert any("spill to disk" in a for a in tight.actions) and any("onnxruntime runs" in a for a in tight.actions)
    assert "memory: about" in tight.line() and "spill to disk" in tight.line()
    fixed = plan(analysis, live, 500, 1, True, None, available=lambda: 256 << 20)
    assert fixed.run_batch == 1 and not any("onnxruntime" in a for a in fixed.actions)


def test_on_the_cpu_a_run_holds_the_largest_power_of_two_batch_within_its_bytes(unet: Path) -> None:
    model = onnxprune.load(str(unet))
    analysis = analyze(model)
    live = Liveness(analysis.graph)
    roomy = plan(analysis, live, 500, 32, False, None, available=lambda: 64 << 30)
    peak = roomy.parts["onnxruntime batch"] // (2 * 32)  # a sample's activations at the widest node
    for per_run, batch in ((5 * peak, 4), (8 * peak, 8), (peak // 2, 2), (1000 * peak, 32)):
        bounded = plan(analysis, live, 500, 32, False, None, available=lambda: 64 << 30, per_run=per_run)
        assert bounded.run_batch == batch and bounded.actions == []
        assert bounded.parts["statistics"] == roomy.parts["statistics"]  # its chunk is not the run's batch
    assert plan(analysis, live, 500, 4, True, None, available=lambda: 64 << 30, per_run=peak).run_batch == 4
    calib = np.random.default_rng(1).standard_normal((8, 3, 128, 128)).astype(np.float32)
    done = onnxprune.compress(str(unet), calib, budget=onnxprune.Ratio(0.8), provider="cpu")
    assert done.report.memory["run_batch"] == plan(analysis, live, 8, 32, False, None, per_run=RUN_BYTES).run_batch < 32


def test_a_group_whose_statistics_cannot_fit_is_left_unpruned_before_any_work(tmp_path: Path, monkeypatch) -> None:
    """A conv whose channels reach a Gemm over the flattened 32x32 map: that consumer reads 16384 columns, and its
    D×D float64 sums alone are 2 GiB a copy (VGG's classifier reads 25088)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3, padding=1),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 32 * 32, 10))
    path = export_torch(net, tmp_path / "wide.onnx", (1, 3, 32, 32))
    analysis = analyze(onnxprune.load(str(path)))
    live = Liveness(analysis.graph)
    assert plan(analysis, live, 8, 8, False, None, available=lambda: 64 << 30).excluded == {}
    blockers = [list(g.blockers) for g in analysis.groups]
    tight = plan(analysis, live, 8, 8, False, None, available=lambda: 4 << 30)
    assert [g.blockers for g in analysis.groups] == blockers  # planning changes no group: the run applies it
    (name, why), = tight.excluded.items()
    assert "16384 columns" in why and "Gemm" in why
    assert any("left unpruned" in a for a in tight.actions)
    monkeypatch.setattr("onnxprune.pipeline.memory.available_memory", lambda: 4 << 30)
    calib = np.random.default_rng(0).standard_normal((8, 3, 32, 32)).astype(np.float32)
    result = onnxprune.compress(str(path), calib, budget=onnxprune.Ratio(0.9))
    assert result.report.memory["excluded"] == {name: why}
    assert any(name in s["group"] and "memory:" in s["reason"] for s in result.report.skipped)


def test_peak_rss_is_the_process_own_not_its_parent_at_the_start() -> None:
    """A compress started by a large process (a benchmark's Python) reports its own peak: ``ru_maxrss`` reported
    the parent's resident size at the spawn (1.5 GiB here) as the child's."""
    held = np.ones(3 << 27)  # 3 GiB / 8 · 8 bytes: 1.5 GiB resident in this process
    code = "from onnxprune.pipeline.memory import peak_rss; print(peak_rss())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0 < child < held.nbytes / 2
    assert peak_rss(Path("/nonexistent")) > 0  # elsewhere: ru_maxrss
