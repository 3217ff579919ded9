"""Quick modes of the rate experiment and of the per-layer error curves, so they cannot silently rot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, out: Path) -> dict:
    subprocess.run([sys.executable, f"benchmarks/{script}.py", "--quick", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    assert (out / f"{script}.md").stat().st_size > 0 and (out / f"{script}.png").stat().st_size > 0
    return json.loads((out / f"{script}.json").read_text())


def test_rate_quick(tmp_path: Path) -> None:
    result = _run("rate", tmp_path)
    n = result["config"]["N"]
    local, layer = result["local"], result["local_layer"]
    assert len(local) == len(layer) == n == len(result["global"])
    # All N neurons with weights 1/N are the layer itself: local imitation must get (almost) there.
    assert layer[-1] < 1e-4 * layer[0] and local[-1] < 1e-4 * local[0]
    assert all(b <= a * (1 + 1e-9) for a, b in zip(layer, layer[1:]))  # best loss per width: never worse
    fits = result["fits"]
    assert math.isfinite(fits["local"]["exp_rate"]) and fits["local"]["exp_rate"] > 0
    assert all(math.isfinite(d) and d >= 0 for d in result["scratch"]["mean"])
    assert "| local | O(e^-λn) |" in (tmp_path / "rate.md").read_text()


def test_layer_curves_quick(tmp_path: Path) -> None:
    result = _run("layer_curves", tmp_path)
    layers = result["layers"]
    assert len(layers) > 3
    for layer in layers:
        widths, loss = layer["widths"], layer["loss"]
        assert widths[0] == 1 and widths[-1] == layer["channels"]
        assert all(len(loss[m]) == len(widths) for m in ("local", "l1", "random"))
        # Keeping every channel with its own weight reproduces the layer (L1 keeps them all at width N).
        assert loss["l1"][-1] < 1e-6 and loss["local"][-1] < loss["local"][0]
    assert any(layer["fit"]["exp_rate"] is not None and layer["fit"]["exp_rate"] > 0 for layer in layers)
    (glob,) = [layer["global"] for layer in layers if "global" in layer]
    assert glob["widths"] and all(math.isfinite(v) and v >= 0 for m in glob["kl"].values() for v in m)
    assert glob["exact_steps"] == result["config"]["exact_until"] + 1
