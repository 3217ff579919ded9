"""Latency-aware allocation: the cost model as plain functions (no timing thresholds), the cost table's
measurement on a tiny model, and `compress --target-latency` end to end with its errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from onnxprune.budget.allocation import check_target, curve_widths, epsilon_widths, group_step, lowest_macs, uniform_widths
from onnxprune.analysis import analyze
from onnxprune.analysis.groups import Group
from onnxprune.calib.sources import load_calibration
from onnxprune.cli import app
from onnxprune.budget.cost import (
    CostTable, GroupCost, _subgraph, graph_sha256, input_dims, isotonic, measure_cost_table, this_machine,
    widths_to_time,
)
from onnxprune.flags.parse import parse_latency
from onnxprune.pipeline import compress, schedule
from onnxprune.errors import ModelError, TargetError
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.cuts import Liveness
from onnxprune.strategies import Latency, options_from
from tests.onnx_builders import export_tiny, run

runner = CliRunner()


def _table(model_ms: float = 10.0) -> CostTable:
    """Two groups: saving a channel of group 0 saves 0.1 ms, of group 1 0.01 ms (both 16 channels)."""
    return CostTable(model_ms, "CPUExecutionProvider", 1, None, "0" * 64, {"x": ["N", 3, 8, 8]}, [
        GroupCost(0, "a", 16, [4, 8, 16], [2.4, 2.8, 3.6]),
        GroupCost(1, "b", 16, [4, 8, 16], [1.0, 1.04, 1.12]),
    ])


GROUPS = [Group(0, 16), Group(1, 16)]


# ---------------------------------------------------------------- the cost model


def test_isotonic_pools_violators() -> None:
    assert isotonic([1.0, 3.0, 2.0]).tolist() == [1.0, 2.5, 2.5]
    assert isotonic([1.0, 2.0, 5.0]).tolist() == [1.0, 2.0, 5.0]
    assert isotonic([3.0, 2.0, 1.0]).tolist() == [2.0, 2.0, 2.0]


@settings(deadline=None)  # a loaded machine must not fail a pure function
@given(st.lists(st.floats(0, 100), min_size=1, max_size=12))
def test_isotonic_is_monotone_and_keeps_the_sum(values: list[float]) -> None:
    fit = isotonic(values)
    assert np.all(np.diff(fit) >= -1e-9)
    assert fit.sum() == pytest.approx(sum(values), abs=1e-6)


@settings(deadline=None)
@given(st.lists(st.floats(0.01, 50), min_size=4, max_size=4))
def test_group_cost_is_monotone_in_width_even_on_noisy_timings(ms: list[float]) -> None:
    g = GroupCost(0, "g", 64, [8, 16, 32, 64], ms)
    costs = [g.at(w) for w in range(1, 65)]
    assert np.all(np.diff(costs) >= -1e-12)
    assert g.saving(64) == 0 and all(g.saving(w) >= 0 for w in range(1, 65))


def test_group_cost_interpolates_linearly() -> None:
    g = GroupCost(0, "g", 16, [8, 16], [1.0, 2.0])
    assert g.at(12) == pytest.approx(1.5) and g.at(16) == 2.0 and g.at(4) == 1.0


def test_cost_table_is_additive_in_the_savings() -> None:
    t = _table()
    assert t({0: 16, 1: 16}) == t({}) == t.total == 10.0
    assert t({0: 8}) == pytest.approx(10.0 - 0.8)
    assert t({1: 8}) == pytest.approx(10.0 - 0.08)
    assert t({0: 8, 1: 8}) == pytest.approx(10.0 - 0.88)
    assert t({0: 12, 1: 4}) == pytest.approx(10.0 - 0.4 - 0.12)


def test_widths_to_time() -> None:
    assert widths_to_time(96, 8, 8) == [8, 24, 48, 72, 96]
    assert widths_to_time(16, 8, 8) == [8, 16]
    assert widths_to_time(10, 1, 1) == [1, 3, 5, 8, 10]
    assert widths_to_time(8, 8, 8) == [8]


# ---------------------------------------------------------------- the allocation spends the table


@pytest.mark.parametrize("allocate", ["uniform", "epsilon", "curve"])
def test_allocations_meet_a_latency_budget(allocate: str) -> None:
    t = _table()
    curves = {g.id: np.concatenate([[np.inf], np.linspace(1, 0, 16)]) for g in GROUPS}
    target = 9.5
    if allocate == "uniform":
        widths = uniform_widths(t, GROUPS, target, round_to=4)
    else:
        widths = (epsilon_widths if allocate == "epsilon" else curve_widths)(t, GROUPS, curves, target, round_to=4)
    assert t(widths) <= target
    assert all(w % 4 == 0 for w in widths.values())
    # fill: no group can take its next step without passing the budget
    assert all(t({**widths, g.id: widths[g.id] + 4}) > target for g in GROUPS if widths[g.id] < g.channels)


def test_curve_allocation_narrows_the_group_that_saves_more_latency() -> None:
    """Same error curves, same MACs: only the latency table tells the groups apart."""
    curves = {g.id: np.concatenate([[np.inf], np.linspace(1, 0, 16)]) for g in GROUPS}
    widths = curve_widths(_table(), GROUPS, curves, 9.6, round_to=4)
    assert widths[0] < widths[1]


def test_unreachable_latency_names_the_lowest_reachable() -> None:
    t = _table()
    assert lowest_macs(t, GROUPS, round_to=4) == pytest.approx(10.0 - 1.2 - 0.12)
    with pytest.raises(TargetError, match=r"unreachable.*at least 8\.68 ms.*best effort prunes") as info:
        check_target(t, GROUPS, 5.0, 4, 4)
    assert info.value.option == "best_effort"
    with pytest.raises(TargetError, match="not below the model's 10 ms"):
        check_target(t, GROUPS, 12.0, 4, 4)


def test_curve_allocation_names_its_own_floor_as_the_lowest_reachable() -> None:
    """The curve/output allocations keep ≥ 25% per group: an unreachable target names that floor's cost (what
    best effort prunes to), not the lower one of groups cut to a single channel."""
    t = CostTable(10.0, "CPUExecutionProvider", 1, None, "0" * 64, {"x": ["N", 3, 8, 8]}, [
        GroupCost(0, "a", 16, [1, 4, 8, 16], [2.0, 2.4, 2.8, 3.6]), GroupCost(1, "b", 16, [1, 4, 16], [0.9, 1.0, 1.12])])
    curves = {g.id: np.concatenate([[np.inf], np.linspace(1, 0, 16)]) for g in GROUPS}
    floor, single = lowest_macs(t, GROUPS, share=0.25), lowest_macs(t, GROUPS)
    assert floor > single
    with pytest.raises(TargetError, match=rf"unreachable.*at least {floor:.3g} ms.*keeps at least 25%.*best effort"):
        curve_widths(t, GROUPS, curves, (floor + single) / 2)


# ---------------------------------------------------------------- parsing and the saved table


@pytest.mark.parametrize("text, expected", [("3.5ms", (3.5, None)), ("800us", (0.8, None)), ("0.002s", (2.0, None)),
                                            ("0.8x", (None, 0.8)), (" 12 MS ", (12.0, None))])
def test_parse_latency(text: str, expected: tuple) -> None:
    ms, ratio = parse_latency(text)
    assert (ms if ms is None else pytest.approx(ms)) == expected[0] and ratio == expected[1]


@pytest.mark.parametrize("text, words", [("fast", "cannot read"), ("3.5", "cannot read"), ("1.2x", "between 0 and 1"),
                                         ("0x", "between 0 and 1"), ("0ms", "positive")])
def test_parse_latency_rejects(text: str, words: str) -> None:
    with pytest.raises(TargetError, match=words):
        parse_latency(text)


def test_cost_table_round_trip_and_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    _table().save(path)
    renumbered = [Group(7, 16, producers=["a"]), Group(9, 16, producers=["b"])]
    loaded = CostTable.load(path, renumbered)
    assert [g.id for g in loaded.groups] == [7, 9]  # matched by name: ids follow the model being pruned
    assert loaded({7: 8, 9: 8}) == pytest.approx(_table()({0: 8, 1: 8}))
    with pytest.raises(ModelError, match="group c with 16 channels"):
        CostTable.load(path, [Group(0, 16, producers=["a"]), Group(1, 16, producers=["c"])])
    with pytest.raises(ModelError, match="not found"):
        CostTable.load(tmp_path / "none.json", renumbered)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ModelError, match="not a cost table"):
        CostTable.load(tmp_path / "bad.json", renumbered)
    old = json.loads(path.read_text()) | {"version": 2}  # timed one run per turn with sleeping threads
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ModelError, match="has version 2, this onnxprune reads 3: measure a new one"):
        CostTable.load(tmp_path / "old.json", renumbered)


# ---------------------------------------------------------------- measuring on a real (tiny) model


def _groups(model: onnx.ModelProto):
    analysis = analyze(model)
    return analysis, [g for _, g in schedule(analysis, Liveness(analysis.graph))[0]]


def test_subgraph_holds_the_group_and_runs_narrowed(tiny) -> None:
    analysis, groups = _groups(tiny.model)
    group = groups[2]
    sub = _subgraph(analysis.graph, group)
    names = {n.name for n in sub.nodes}
    assert set(group.producers) | {c.node for c in group.consumers} <= names
    assert len(names) < len(analysis.graph.nodes)
    table = measure_cost_table(tiny.model, analysis.graph, groups, provider="cpu", batch=2, round_to=4, runs=2,
                               warmup=0, removable=analysis.blocks)
    assert table.provider == "CPUExecutionProvider" and table.batch == 2 and table.model_ms > 0
    assert [(g.name, g.channels) for g in table.groups] == [(g.name, g.channels) for g in groups]
    for g in table.groups:
        assert g.widths == sorted(set(g.widths)) and g.widths[-1] == g.channels
        removable = g.id in analysis.blocks
        if removable:  # removed, the block's whole subgraph costs nothing: removing saves all of it
            assert (g.widths[0], g.ms[0]) == (0, 0.0) and g.saving(0) == pytest.approx(g.at(g.channels))
        else:
            assert g.widths[0] > 0
        step = group_step(g.channels, 4)
        assert all(w % step == 0 or w == g.channels for w in g.widths) and all(ms > 0 for ms in g.ms[removable:])
    assert sum(g.id in analysis.blocks for g in table.groups) == 1


# ---------------------------------------------------------------- compress --target-latency


def _fake_table(tiny, path: Path, **setup) -> CostTable:
    """A table for the tiny model on this machine (``setup`` overrides what it was measured for) whose savings are
    proportional to each group's share of the MACs (deterministic)."""
    analysis, groups = _groups(tiny.model)
    table = CostTable(**{"model_ms": 10.0, "provider": "CPUExecutionProvider", "batch": 1, "threads": None,
                         "graph_sha256": graph_sha256(tiny.model), "inputs": input_dims(tiny.model), **setup})
    for g in groups:
        widths = widths_to_time(g.channels, 4, 4)
        table.groups.append(GroupCost(g.id, g.name, g.channels, widths,
                                      [table.model_ms * 1e-6 * analysis.macs.macs({g.id: w}) for w in widths]))
    table.save(path)
    return table


def _calib(tiny):
    return load_calibration(str(tiny.calib), model_input_specs(tiny.model))


def _timed_for_real(lat) -> None:
    """The report's timings come from onnxruntime runs (not the table), and ``met`` is what they say."""
    assert lat.measured_ms > 0 and lat.original_ms > 0 and lat.measured_ms != lat.original_ms
    bound = lat.target_ms if lat.target_ratio is None else lat.target_ratio * lat.original_ms
    assert lat.met == (lat.measured_ms <= bound), lat


# The tiny model runs in well under a millisecond and never in a microsecond: a table that calls it 10 ms
# makes a 9 ms target met by the real timing, one that calls it 1 us makes 0.9 us missed.
@pytest.mark.parametrize("model_ms, met", [(10.0, True), (1e-3, False)])
def test_compress_reports_predicted_and_measured_latency(tiny, tmp_path: Path, model_ms: float, met: bool) -> None:
    table = _fake_table(tiny, tmp_path / "t.json", model_ms=model_ms)
    options = options_from(Latency(ms=0.9 * model_ms, cost_table=str(tmp_path / "t.json")), round_to=4)
    pruned, report = compress(tiny.model, _calib(tiny), options)
    lat = report.latency
    assert lat.target_ms == 0.9 * model_ms and lat.predicted_ms <= lat.target_ms and lat.batch == 1
    assert lat.predicted_ms == pytest.approx(table(
        {g.id: next((layer.kept for layer in report.layers if layer.group == g.name), g.channels)
         for g in table.groups}))
    _timed_for_real(lat)
    assert lat.met is met
    assert report.macs_after < report.macs_before and report.target_macs == pytest.approx(report.macs_after)
    x = tiny.x[:2]
    assert run(pruned, input=x)[0].shape == (2, 10)


@pytest.mark.parametrize("model_ms", [10.0, 1e-3])
def test_ratio_target_is_judged_against_the_original_timed_with_it(tiny, tmp_path: Path, model_ms: float) -> None:
    """Whatever the table says the original takes (far more or far less than it does), a 0.9x target is met
    when the pruned model runs in 0.9x of the original timed in the same rounds."""
    _fake_table(tiny, tmp_path / "t.json", model_ms=model_ms)
    _, report = compress(tiny.model, _calib(tiny), options_from(Latency(ratio=0.9, cost_table=tmp_path / "t.json"),
                                                              round_to=4))
    assert report.latency.target_ms == pytest.approx(0.9 * model_ms) and report.latency.target_ratio == 0.9
    _timed_for_real(report.latency)


def test_cli_target_latency_measures_saves_and_warns_when_missed(tiny, tmp_path: Path) -> None:
    out, table, report = tmp_path / "p.onnx", tmp_path / "t.json", tmp_path / "r.json"
    result = runner.invoke(app, ["compress", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib),
                                 "--target-latency", "0.9x", "--latency-batch", "2", "--threads", "1",
                                 "--save-cost-table", str(table), "--report", str(report)])
    assert result.exit_code == 0, result.stderr
    assert "predicted" in result.stdout and "measured" in result.stdout
    saved = json.loads(table.read_text())
    assert saved["batch"] == 2 and saved["threads"] == 1 and len(saved["groups"]) == len(_groups(tiny.model)[1])
    assert saved["graph_sha256"] == graph_sha256(tiny.model) and saved["inputs"] == {"input": ["batch", 3, 32, 32]}
    assert saved["provider"] == "CPUExecutionProvider" and saved["machine"] == this_machine()
    lat = json.loads(report.read_text())["latency"]
    assert lat["batch"] == 2 and lat["table_seconds"] > 0 and out.is_file()
    assert lat["met"] == (lat["measured_ms"] <= 0.9 * lat["original_ms"]) and lat["measured_ms"] > 0
    assert ("misses the 0.9x target" in result.stderr) == (not lat["met"]), (lat, result.stderr)


@pytest.mark.parametrize("machine", [{}, {"host": "elsewhere"}])
def test_cli_cost_table_from_another_machine_is_used_with_a_warning(tiny, tmp_path: Path, machine: dict) -> None:
    # the table says 10 ms, the tiny model really runs in well under 9 ms: the target is met, no other warning
    _fake_table(tiny, tmp_path / "t.json", machine={**this_machine(), **machine})
    out, report = tmp_path / "p.onnx", tmp_path / "r.json"
    result = runner.invoke(app, ["compress", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib),
                                 "--target-latency", "9ms", "--cost-table", str(tmp_path / "t.json"),
                                 "--report", str(report), "--quiet"])  # stderr: the warnings alone
    assert result.exit_code == 0, result.stderr
    assert out.is_file()
    noted = json.loads(report.read_text())["latency"]["table_machine"]
    if not machine:
        assert noted is None and result.stderr == ""
        return
    assert noted == f"host 'elsewhere', here {this_machine()['host']!r}"
    assert result.stderr.startswith(f"warning: the cost table was measured on another machine ({noted})")


LATENCY_BAD = {
    "unparseable": (["--target-latency", "quick"], ["cannot read 'quick' as a latency", "0.8x"]),
    "unreachable": (["--target-latency", "0.0001ms", "--cost-table", "{table}"], ["unreachable", "at least", "ms",
                                                                                  "--best-effort"]),
    "no-provider": (["--target-latency", "0.9x", "--provider", "cuda"], ["CUDAExecutionProvider is not available",
                                                                        "use the cpu provider (--provider)"]),
    "two-targets": (["--target-latency", "0.9x", "--target-ratio", "0.5"], ["exactly one", "--target-latency"]),
    "table-without-target": (["--target-ratio", "0.5", "--cost-table", "{table}"], ["go with --target-latency"]),
    "table-other-batch": (["--target-latency", "0.9x", "--cost-table", "{table}", "--latency-batch", "8"],
                          ["measured at batch 1, not 8", "time at batch 1", "(--latency-batch)"]),
    "table-other-model": (["--target-latency", "0.9x", "--cost-table", "{other}"], ["does not fit this model"]),
    "table-other-threads": (["--target-latency", "0.9x", "--cost-table", "{table}", "--threads", "2"],
                            ["measured with onnxruntime's default threads, not 2 intra-op threads",
                             "use onnxruntime's default threads", "(--threads)"]),
    "table-other-provider": (["--target-latency", "0.9x", "--cost-table", "{cuda}"],
                             ["measured on CUDAExecutionProvider, not CPUExecutionProvider", "use the cuda provider",
                              "(--provider)"]),
    "table-other-input-size": (["--target-latency", "0.9x", "--cost-table", "{larger}"],
                               ["measured for inputs input:batchx3x64x64, not this model's input:batchx3x32x32",
                                "instead of reading this one (--cost-table)"]),
    # the same architecture with other weights: same groups, another graph hash
    "table-other-weights": (["--target-latency", "0.9x", "--cost-table", "{seed1}"],
                            ["measured for another model with the same groups (other weights",
                             "instead of reading this one (--cost-table)"]),
}


@pytest.mark.parametrize("name", list(LATENCY_BAD))
def test_cli_latency_bad_inputs(tiny, tmp_path: Path, name: str) -> None:
    tables = {"table": {}, "cuda": {"provider": "CUDAExecutionProvider"},
              "larger": {"inputs": {"input": ["batch", 3, 64, 64]}},
              "seed1": {"graph_sha256": graph_sha256(onnx.load(str(export_tiny(tmp_path / "seed1.onnx", seed=1))))}}
    for key, setup in tables.items():
        _fake_table(tiny, tmp_path / f"{key}.json", **setup)
    other = _table()
    other.save(tmp_path / "other.json")
    flags, words = LATENCY_BAD[name]
    flags = [f.format(**{key: tmp_path / f"{key}.json" for key in [*tables, "other"]}) for f in flags]
    out = tmp_path / "p.onnx"
    result = runner.invoke(app, ["compress", str(tiny.path), "-o", str(out), "--calib", str(tiny.calib), *flags])
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    assert not out.exists()
