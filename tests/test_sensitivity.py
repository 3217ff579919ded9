"""The output allocation: its pure pieces on arrays, its probes on the tiny model, its budget end to end."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from onnxprune.analysis.groups import Group
from onnxprune.calib.sources import load_calibration
from onnxprune.errors import AnalysisError, CalibrationError, OptionError
from onnxprune.pipeline import Compressor, compress, schedule
from onnxprune.imitation.refit import refit_cv, refit_full
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.cuts import cut_graph
from onnxprune.strategies.objects import run_chunks
from onnxprune.strategies.sensitivity import Sensitivity, _probe, candidate_widths, curve_of, split
from onnxprune.tasks import raw_discrepancy
from onnxprune.strategies import Output, Ratio, Recoverable, options_from
from onnxprune.strategies import allocators
from tests.onnx_builders import GraphBuilder, run


def _calib(tiny):
    return load_calibration(str(tiny.calib), model_input_specs(tiny.model))


def test_discrepancy_is_kl_for_logits_and_relative_error_otherwise() -> None:
    rng = np.random.default_rng(0)
    ref, out = rng.standard_normal((6, 10)), rng.standard_normal((6, 10))
    p = np.exp(ref) / np.exp(ref).sum(1, keepdims=True)
    q = np.exp(out) / np.exp(out).sum(1, keepdims=True)
    kl = float(np.mean(np.sum(p * np.log(p / q), axis=1)))
    maps, noisy = rng.standard_normal((6, 2, 3, 3)), rng.standard_normal((6, 2, 3, 3))
    rel = float(np.sum((noisy - maps) ** 2) / np.sum(maps**2))
    assert raw_discrepancy([{"logits": ref}], [{"logits": out}]) == pytest.approx(kl)
    both = raw_discrepancy([{"logits": ref, "map": maps}], [{"logits": out, "map": noisy}])
    assert both == pytest.approx(kl + rel)
    # chunk by chunk (4 + 2 samples) it is the same figure; a sequence-first output (T, B, C) is compared whole
    chunks = [({"logits": ref[:4], "map": maps[:4]}, {"logits": out[:4], "map": noisy[:4]}),
              ({"logits": ref[4:], "map": maps[4:]}, {"logits": out[4:], "map": noisy[4:]})]
    assert raw_discrepancy(*zip(*chunks)) == pytest.approx(both)
    seq = maps.transpose(2, 0, 1, 3).reshape(3, 6, 6)
    assert raw_discrepancy([{"seq": seq}], [{"seq": 2 * seq}]) == pytest.approx(1.0)
    assert raw_discrepancy([{"logits": ref}], [{"logits": ref}]) == pytest.approx(0.0, abs=1e-12)


def test_curve_interpolates_the_probes_and_never_rises_with_width() -> None:
    curve = curve_of(16, {12: 0.1, 8: 0.05, 4: 1.0})  # the 12-wide probe is noisier than the 8-wide one
    assert curve[0] == np.inf and curve[16] == 0.0
    assert curve[12] == pytest.approx(0.1) and curve[8] == pytest.approx(0.1)  # raised to the wider probe
    assert curve[14] == pytest.approx(0.05) and curve[6] == pytest.approx(0.55) and curve[2] == pytest.approx(1.0)
    assert np.all(np.diff(curve[1:]) <= 0)


def test_candidate_widths_are_rounded_distinct_and_below_the_channels() -> None:
    assert candidate_widths(96, (0.75, 0.5, 0.25), 8) == [72, 48, 24]
    assert candidate_widths(12, (0.75, 0.5, 0.25), 8) == [8, 6, 4]  # a narrow group steps by 2 (group_step)
    assert candidate_widths(16, (0.6, 0.55, 0.5), 1) == [10, 9, 8]
    assert candidate_widths(8, (0.99,), 8) == []  # rounds to the full width: nothing to probe


def test_split_keeps_pairs_together_and_sides_apart() -> None:
    fit, probe = split(40, 8, 4)
    assert len(fit) == 8 and len(probe) == 4 and not set(fit) & set(probe)
    assert all(i // 2 % 2 == 0 for i in fit) and all(i // 2 % 2 == 1 for i in probe)
    with pytest.raises(CalibrationError, match="at least 6 calibration samples"):
        split(5, 8, 4)


def test_output_options_are_checked() -> None:
    with pytest.raises(OptionError, match="strictly between 0 and 1"):
        Output(ratios=(0.5, 1.0))
    with pytest.raises(OptionError, match="at least 2 samples to fit on"):
        Output(fit_samples=1)


def test_a_probe_keeping_every_channel_reproduces_the_original_output(tiny) -> None:
    """The probe's plumbing: refit written into the right columns of a copy, run from the cut's tensors. With
    every channel kept the refit finds the original weights again, so the output matches the reference."""
    run_ = Compressor(tiny.model, _calib(tiny), options_from(Ratio(0.6), provider="cpu"))
    order, _ = schedule(run_.analysis, run_.live)
    values = dict(run_.inputs)
    names = {t.name for t in run_.original.outputs}
    reference = run_chunks(run_, cut_graph(run_.original, values, names), values)
    cut, group = order[2]
    run_.advance(run_.original, values, cut)
    ahead = run_.peek(run_.original, values, {use.tensor for use in group.consumers})
    full = _probe(run_, group, ahead, values, reference, [group.channels])[group.channels]
    half = _probe(run_, group, ahead, values, reference, [group.channels // 4])[group.channels // 4]
    assert full < 1e-6 < half, (full, half)


def _probed(tiny, widths: Callable[[int], list[int]]) -> tuple[dict[int, float], Group]:
    """The tiny model's third group probed at ``widths(its channels)``, and the group."""
    run_ = Compressor(tiny.model, _calib(tiny), options_from(Ratio(0.6), provider="cpu"))
    order, _ = schedule(run_.analysis, run_.live)
    values = dict(run_.inputs)
    reference = run_chunks(run_, cut_graph(run_.original, values, {t.name for t in run_.original.outputs}), values)
    cut, group = order[2]
    run_.advance(run_.original, values, cut)
    ahead = run_.peek(run_.original, values, {use.tensor for use in group.consumers})
    return _probe(run_, group, ahead, values, reference, widths(group.channels)), group


def test_a_probes_session_does_not_pre_pack_its_weights(tiny, monkeypatch) -> None:
    """The probes' session runs each width once: onnxruntime leaves its weights unpacked (``prepack=False``)."""
    import onnxprune.strategies.sensitivity as sensitivity

    made, real = [], sensitivity.FedCut
    monkeypatch.setattr(sensitivity, "FedCut", lambda *args, **kwargs: made.append(real(*args, **kwargs)) or made[-1])
    _probed(tiny, lambda channels: [channels // 2])
    options = made[0].session.get_session_options()
    assert options.get_session_config_entry("session.disable_prepacking") == "1"


def test_a_probe_cross_validates_the_ridge_at_its_widest_width_only(tiny, monkeypatch) -> None:
    """The cross-validated refit (13 solves) runs once per consumer, at the widest probe; the narrower probes
    refit with the ridge it chose (one solve each)."""
    import onnxprune.strategies.sensitivity as sensitivity

    chosen, reused = [], []

    def cv(*args, **kwargs):
        out = refit_cv(*args, **kwargs)
        chosen.append(out[2])
        return out

    def full(stats, cols, ridge, prior):
        reused.append(ridge)
        return refit_full(stats, cols, ridge, prior=prior)

    monkeypatch.setattr(sensitivity, "refit_cv", cv)
    monkeypatch.setattr(sensitivity, "refit_full", full)
    probes, group = _probed(tiny, lambda channels: candidate_widths(channels, (0.75, 0.5, 0.25), 1))
    widths = candidate_widths(group.channels, (0.75, 0.5, 0.25), 1)
    assert len(widths) == 3 and sorted(probes) == sorted(widths)
    assert len(chosen) == len(group.consumers) and reused == chosen * (len(widths) - 1)


def test_output_allocation_meets_the_budget_and_records_its_probes(tiny) -> None:
    options = options_from(Ratio(0.7), allocate=Output(fit_samples=16, probe_samples=16), provider="cpu",
                           round_to=1)
    pruned, report = compress(tiny.model, _calib(tiny), options)
    assert 0.69 * report.macs_before <= report.macs_after <= 0.7 * report.macs_before
    probes = report.allocation["probes"]
    assert report.allocation["fit_samples"] == 16 and report.allocation["seconds"] > 0
    for layer in report.layers:  # never below the narrowest ratio probed
        assert layer.kept >= 0.25 * layer.channels, layer
    run_ = Compressor(tiny.model, _calib(tiny), options)
    widths = {g.name: g.channels for _, g in schedule(run_.analysis, run_.live)[0]}
    assert set(probes) == set(widths)
    for name, row in probes.items():
        assert row and all(0 < w < widths[name] and d >= 0 for w, d in row.items()), (name, row)
    (y,) = run(pruned, input=np.load(tiny.calib)[:4])
    assert np.isfinite(y).all()


def test_the_recover_allocation_weighs_the_last_third_of_the_groups_and_narrows_them_less(monkeypatch) -> None:
    # six groups of 16 channels, in order; the last two the cheapest to narrow as probed
    probed = {i: np.linspace(1.0 if i < 4 else 0.5, 0.0, 17) for i in range(6)}
    for c in probed.values():
        c[0] = np.inf  # no group can go whole (as ``curve_of``'s)
    monkeypatch.setattr(allocators, "output_curves", lambda *a, **k: ({i: c.copy() for i, c in probed.items()},
                                                                       Sensitivity()))
    order = [(0, Group(i, 16)) for i in range(6)]
    curves, _ = Recoverable(late_share=1 / 3, late_weight=3.0).curves(None, order, None)
    for i in range(6):
        np.testing.assert_allclose(curves[i], probed[i] * (3.0 if i >= 4 else 1.0))

    class Count:  # a cost of 1 per channel
        total = 96.0

        def __call__(self, widths: dict[int, int]) -> float:
            return float(sum(widths.values()))

        def show(self, value: float) -> str:
            return f"{value:.0f}"

    groups = [g for _, g in order]
    plain = Output().widths(Count(), groups, probed, 60.0, 1, 1)
    weighed = Recoverable().widths(Count(), groups, curves, 60.0, 1, 1)
    assert sum(weighed.values()) <= 60 and sum(plain.values()) <= 60
    assert plain[4] == plain[5] == 4  # the output allocation narrows them to its floor ...
    assert weighed[4] == weighed[5] == 16  # ... weighed three times, they are the dearest and stay whole
    assert sum(weighed[i] for i in range(4)) < sum(plain[i] for i in range(4))  # the first groups pay for it
    with pytest.raises(OptionError, match="late_share"):
        Recoverable(late_share=0.0)


def test_a_graph_with_no_float_output_is_refused(tmp_path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 3, 1, 1)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 8, 1, 1)).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w1"], ["h"], name="c1"), helper.make_node("Relu", ["h"], ["r"], name="r"),
         helper.make_node("Conv", ["r", "w2"], ["y"], name="c2"),
         helper.make_node("ArgMax", ["y"], ["label"], name="argmax", axis=1, keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 4])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, ["N", 4, 4])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    np.save(tmp_path / "x.npy", rng.standard_normal((12, 3, 4, 4)).astype(np.float32))
    calib = load_calibration(str(tmp_path / "x.npy"), model_input_specs(model))
    with pytest.raises(AnalysisError, match="compares float outputs"):
        compress(model, calib, options_from(Ratio(0.6), allocate=Output(), provider="cpu", round_to=1))


def test_probe_samples_are_sized_to_a_budget_of_forward_passes() -> None:
    from onnxprune.strategies.sensitivity import MIN_PROBE_SAMPLES, PROBE_PASSES, probe_count

    # 20 groups of 3 widths, each probe running half the network: 30 forward passes per probe sample
    assert probe_count(500, 32, [3] * 20, [0.5] * 20) == 32  # 4 passes of 500 samples allow 66
    assert probe_count(240, 32, [3] * 20, [0.5] * 20) == PROBE_PASSES * 240 // 30
    assert probe_count(16, 32, [3] * 20, [0.5] * 20) == MIN_PROBE_SAMPLES
    assert probe_count(16, 32, [], []) == 32


def test_a_probes_session_runs_only_what_its_consumers_change() -> None:
    """A head the consumer does not feed is computed once when the session is made (``segments.settle``), not in
    every candidate's run: the session reads the tensors at the frontier, and each candidate's outputs are the ones
    of the whole cut run every time."""
    import onnx_graphsurgeon as gs

    from onnxprune.analysis import consumers
    from onnxprune.strategies.downstream import FedCut

    b = GraphBuilder({"x": ["N", 3, 8, 8]})
    stem = b.op("Relu", [b.conv("x", "stem", 3, 8)], "stem_relu")
    hidden = b.op("Relu", [b.conv(stem, "a", 8, 8)], "a_relu")
    graph = gs.import_onnx(b.model([b.conv(hidden, "b", 8, 4, 1), b.conv(stem, "other_head", 8, 5)]))
    x = {"x": np.random.default_rng(0).standard_normal((3, 3, 8, 8)).astype(np.float32)}
    outputs = [t.name for t in graph.outputs]
    whole = FedCut(graph, x, ["b"], outputs, provider="cpu", settle_once=False)
    settled = FedCut(graph, x, ["b"], outputs, provider="cpu")
    assert set(whole.at_cut) == {"x"} and set(settled.at_cut) == {"a_relu_out", "other_head_out"}
    nodes = {n.name: n for n in graph.nodes}
    base = consumers.matrix(nodes["b"])
    for scale in (1.0, 0.5, -2.0):
        linears = [consumers.Linear(scale * base.weight, base.bias + scale, base.k)]
        ran = [whole.run(linears, whole.at_cut, 2), settled.run(linears, settled.at_cut, 2)]
        for before, after in zip(*ran, strict=True):
            assert before.keys() == after.keys()
            for name in before:
                np.testing.assert_array_equal(before[name], after[name])
