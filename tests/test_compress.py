"""The layer-wise pipeline on a tiny MobileNetV2-like model with 64 random calibration samples."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest

from onnxprune.analysis import analyze
from onnxprune.analysis.groups import kept_entries
from onnxprune.budget.allocation import group_step
from onnxprune.calib.sources import load_calibration
from onnxprune.pipeline import Compressor, compress, schedule
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.cuts import Liveness
from onnxprune.strategies import (
    METHODS, RECONSTRUCTIONS, Epsilon, Global, Local, MACs, NoRefit, Random, Ratio, Refit, Scale, named,
    options_from,
)
from tests.onnx_builders import run, session

RATIO = 0.6


def _calib(tiny):
    return load_calibration(str(tiny.calib), model_input_specs(tiny.model))


@pytest.fixture(scope="module")
def pruned(tiny):
    """(method, reconstruct) -> (pruned model, report), computed on first use."""
    cache: dict[tuple[str, str], tuple[onnx.ModelProto, object]] = {}

    def get(method: str, reconstruct: str):
        if (method, reconstruct) not in cache:
            # round_to=1: channel granularity, so the budget can be met within 1% on this tiny net
            select, allocate, refit = named(method, "epsilon", reconstruct)
            options = options_from(Ratio(RATIO), select, allocate, refit, provider="cpu", round_to=1)
            cache[method, reconstruct] = compress(tiny.model, _calib(tiny), options)
        return cache[method, reconstruct]

    return get


def _rel(y: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def test_tiny_model_schedule(tiny) -> None:
    """The tiny model has 5 layer-wise prunable groups and a residual stream (12 channels, two producers),
    scheduled at its first consumer when asked; the logits are left alone."""
    run_ = Compressor(tiny.model, _calib(tiny), options_from(Ratio(RATIO), provider="cpu"))
    order, skipped = schedule(run_.analysis, run_.live)
    assert [g.channels for _, g in order] == [16, 8, 32, 48, 64]
    reasons = {s["channels"]: s["reason"] for s in skipped}
    assert "--residual-streams" in reasons[12] and "graph output" in reasons[10]
    order, skipped = schedule(run_.analysis, run_.live, streams=True)
    assert [g.channels for _, g in order] == [16, 8, 32, 12, 48, 64] and len(order[3][1].producers) == 2
    assert [s["channels"] for s in skipped] == [10]


def _keep_all(tiny, reconstruct) -> tuple[onnx.ModelProto, list[tuple[float, float]]]:
    """Run the pipeline's pieces keeping every channel with the simplex weights a_i = 1/N."""
    run_ = Compressor(tiny.model, _calib(tiny), options_from(Ratio(RATIO), reconstruct=reconstruct, provider="cpu"))
    order, _ = schedule(run_.analysis, run_.live)
    errors = []
    for cut, group in order:
        run_.advance(run_.graph, run_.values_p, cut)
        run_.advance(run_.original, run_.values_o, cut)
        need = {use.tensor for use in group.consumers}  # a stream's later consumers read ahead of the cut
        data = run_.collect(group, run_.peek(run_.graph, run_.values_p, need),
                            run_.peek(run_.original, run_.values_o, need))
        n = group.channels
        keep, a = np.arange(n), np.full(n, 1.0 / n)
        entries = kept_entries(run_.graph, group, keep)
        errors.append(tuple(run_.apply(group, data, keep, n * a, entries)[:2]))  # (error_fold, error, ...)
    return run_.export(), errors


def test_keep_all_uniform_fold_leaves_model_unchanged(tiny) -> None:
    model, errors = _keep_all(tiny, NoRefit())
    # relative errors from streamed float32 statistics: zero up to cancellation
    assert all(abs(e_fold) < 1e-5 and abs(e) < 1e-5 for e_fold, e in errors), errors
    (ref,) = run(tiny.model, input=tiny.x)
    (got,) = run(model, input=tiny.x)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


def test_keep_all_full_refit_reproduces_outputs(tiny) -> None:
    model, errors = _keep_all(tiny, Refit())
    assert all(abs(e) < 1e-4 for _, e in errors), errors
    (ref,) = run(tiny.model, input=tiny.x)
    (got,) = run(model, input=tiny.x)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    assert _rel(got, ref) < 1e-4


@pytest.mark.parametrize("method,reconstruct", list(itertools.product(METHODS, RECONSTRUCTIONS)))
def test_ratio_target_gives_valid_dynamic_batch_model(tiny, pruned, method: str, reconstruct: str) -> None:
    model, report = pruned(method, reconstruct)
    before = analyze(tiny.model).macs.total
    after = analyze(model).macs.total
    assert report.macs_before == before and report.macs_after == after
    assert 0.59 * before <= after <= RATIO * before, after / before
    assert len(report.layers) == 5
    onnx.checker.check_model(model, full_check=True)
    sess = session(model)
    assert [i.name for i in sess.get_inputs()] == ["input"]
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    for batch in (1, 5):
        (y,) = sess.run(None, {"input": tiny.x[:batch]})
        assert y.shape == (batch, 10) and np.isfinite(y).all()
    (y1,) = sess.run(None, {"input": tiny.x[:1]})
    (y5,) = sess.run(None, {"input": tiny.x[:5]})
    np.testing.assert_allclose(y1[0], y5[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_first_layer_error_refit_le_scale_le_none(pruned, method: str) -> None:
    """On the first pruned layer the inputs are the same in every mode, and so is the selection."""
    first = {r: pruned(method, r)[1].layers[0] for r in RECONSTRUCTIONS}
    assert len({(l.group, l.kept) for l in first.values()}) == 1
    assert first["none"].error_fold == pytest.approx(first["scale"].error_fold, rel=1e-9)
    assert first["none"].error == pytest.approx(first["none"].error_fold, rel=1e-9)
    tol = 1e-9
    assert first["refit"].error <= first["scale"].error + tol
    assert first["scale"].error <= first["none"].error + tol


def test_local_imitation_beats_l1_and_random(tiny, pruned) -> None:
    """With the paper's fold (no refit), local imitation's logits are far closer to the original."""
    (ref,) = run(tiny.model, input=tiny.x)
    errors, macs = {}, set()
    for method in METHODS:
        model, report = pruned(method, "none")
        (y,) = run(model, input=tiny.x)
        errors[method] = _rel(y, ref)
        macs.add(report.macs_after)
    assert len(macs) == 1, "same allocation for every method"
    assert errors["local"] < 0.5 * min(errors["l1"], errors["random"]), errors


def test_target_macs_absolute(tiny) -> None:
    total = analyze(tiny.model).macs.total
    model, report = compress(tiny.model, _calib(tiny),
                             options_from(MACs(0.75 * total), reconstruct=Scale(), provider="cpu", round_to=1))
    assert 0.74 * total <= report.macs_after <= 0.75 * total
    assert report.target_macs == pytest.approx(0.75 * total)


def test_paper_target_runs(tiny, pruned) -> None:
    model, report = compress(tiny.model, _calib(tiny),
                             options_from(Ratio(RATIO), Local("paper"), Epsilon(), NoRefit(), provider="cpu",
                                          round_to=1))
    assert report.macs_after == pruned("local", "none")[1].macs_after
    assert all(layer.imitation_loss is None or layer.imitation_loss >= -1e-9 for layer in report.layers)
    (y,) = run(model, input=tiny.x[:4])
    assert y.shape == (4, 10) and np.isfinite(y).all()


def test_fewer_samples_than_one_batch(tiny, tmp_path) -> None:
    np.save(tmp_path / "few.npy", tiny.x[:16])
    calib = load_calibration(str(tmp_path / "few.npy"), model_input_specs(tiny.model))
    model, report = compress(tiny.model, calib, options_from(Ratio(RATIO), provider="cpu"))
    assert report.calibration_samples == 16 and report.macs_after <= RATIO * report.macs_before


def _conv_chain_without_bias():
    from tests.onnx_builders import GraphBuilder

    b = GraphBuilder({"input": ["batch", 3, 16, 16]})
    y = b.op("Relu", [b.bn(b.conv("input", "c1", 3, 12, bias=False), "bn1", 12)], "r1")
    y = b.op("Relu", [b.bn(b.conv(y, "c2", 12, 16, bias=False), "bn2", 16)], "r2")
    y = b.op("Flatten", [b.op("GlobalAveragePool", [b.conv(y, "c3", 16, 8)], "gap")], "flat")
    return b.model([b.gemm(y, "fc", 8, 5)]), (64, 3, 16, 16)


def _matmul_chain():
    from tests.onnx_builders import GraphBuilder

    b = GraphBuilder({"input": ["batch", 4, 6]})
    h = b.op("Relu", [b.matmul("input", "m1", 6, 10)], "r1")
    h = b.op("Relu", [b.matmul(h, "m2", 10, 8)], "r2")
    return b.model([b.matmul(h, "m3", 8, 3)]), (64, 4, 6)


def _with_output(model: onnx.ModelProto, tensor: str) -> onnx.ModelProto:
    """``model`` with ``tensor`` added as a second graph output."""
    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    tapped.graph.output.append(onnx.helper.make_tensor_value_info(tensor, onnx.TensorProto.FLOAT, None))
    return tapped


@pytest.mark.parametrize("builder, last_input", [(_conv_chain_without_bias, "flat_out"), (_matmul_chain, "r2_out")],
                         ids=["conv-no-bias", "matmul"])
def test_full_refit_of_consumers_without_bias_input(builder, last_input: str, tmp_path) -> None:
    """The refit gives a consumer a bias; pruning that node's own output group next must slice it too.
    Oracle: the last consumer (the graph output) refit on the pruned model's own input to it is the
    least-squares fit of the original's output with a bias (numpy), up to the refit's small ridge."""
    model, shape = builder()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.save(tmp_path / "calib.npy", x)
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    # the ε widths: the oracle's 2% margin for the refit's ridge was set on them
    options = options_from(Ratio(0.5), allocate=Epsilon(), reconstruct=Refit(), provider="cpu", round_to=1)
    pruned_model, report = compress(model, calib, options)
    assert len(report.layers) >= 2
    onnx.checker.check_model(pruned_model, full_check=True)
    y, h = run(_with_output(pruned_model, last_input), input=x)
    (ref,) = run(model, input=x)
    h = h.reshape(-1, h.shape[-1]).astype(np.float64)
    target = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    design = np.hstack([h, np.ones((len(h), 1))])
    fit = design @ np.linalg.lstsq(design, target, rcond=None)[0]
    best = float(np.linalg.norm(fit - target) / np.linalg.norm(target))
    assert y.shape == ref.shape and best - 1e-6 <= _rel(y, ref) <= 1.02 * best, (_rel(y, ref), best)


@pytest.mark.parametrize("allocation", ["uniform", "epsilon", "curve"])
def test_allocations_meet_the_budget(tiny, allocation: str) -> None:
    """The written model's MACs are within 1% under the budget. Uniform keeps about the same ratio in every
    scheduled group (up to a channel of the 8-wide group, 1/8); the error-driven allocations spread it."""
    analysis = analyze(tiny.model)
    total = analysis.macs.total
    options = options_from(Ratio(0.7), allocate=named("omp", allocation, "refit")[1], provider="cpu", round_to=1)
    pruned_model, report = compress(tiny.model, _calib(tiny), options)
    assert analyze(pruned_model).macs.total == report.macs_after
    assert 0.69 * total <= report.macs_after <= 0.7 * total
    kept = {layer.group: layer.kept for layer in report.layers}
    ratios = [kept.get(g.name, g.channels) / g.channels for _, g in schedule(analysis, Liveness(analysis.graph))[0]]
    spread = max(ratios) - min(ratios)
    assert (spread <= 1 / 8) if allocation == "uniform" else (spread >= 0.5), ratios


def test_round_to_keeps_widths_multiples(tiny) -> None:
    _, report = compress(tiny.model, _calib(tiny), options_from(Ratio(0.7), provider="cpu", round_to=8))
    assert report.layers and report.macs_after <= 0.7 * report.macs_before
    for layer in report.layers:  # a group narrower than 32 channels steps by a quarter of it (a power of two)
        assert layer.step == (8 if layer.channels >= 32 else group_step(layer.channels, 8)), layer
        assert layer.kept % layer.step == 0 or layer.kept == layer.channels, (layer.group, layer.kept)
    assert any(layer.step == 8 for layer in report.layers)


def test_global_method_prunes_a_small_chain(tmp_path) -> None:
    """--method global runs end to end (greedy global imitation of the final output's softmax) and
    keeps it closer to the original's, in KL, than random channels at the same MACs."""
    model, shape = _conv_chain_without_bias()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    np.save(tmp_path / "calib.npy", x)
    calib = load_calibration(str(tmp_path / "calib.npy"), model_input_specs(model))
    (ref,) = run(model, input=x)
    errors = {}
    for method, select in (("global", Global()), ("random", Random())):
        options = options_from(Ratio(0.5), select, reconstruct=NoRefit(), provider="cpu", round_to=1)
        pruned_model, report = compress(model, calib, options)
        (y,) = run(pruned_model, input=x)
        errors[method] = _kl(ref, y)
    assert errors["global"] < errors["random"], errors


def _kl(ref: np.ndarray, y: np.ndarray) -> float:
    lp = ref - np.logaddexp.reduce(ref, axis=1, keepdims=True)
    lq = y - np.logaddexp.reduce(y, axis=1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(axis=1).mean())


def test_a_float16_model_compresses_in_float16_as_its_float32_twin(tiny) -> None:
    """A model converted to float16 by onnxconverter-common (float32 input and output, float16 weights and
    activations inside) is pruned with its statistics in float32 and its weights written back in float16: the
    widths of the float32 model (the same uniform ratio), and outputs within float16 rounding of its pruned twin's."""
    from onnxconverter_common import float16

    half = float16.convert_float_to_float16(tiny.model, keep_io_types=True)
    options = options_from(Ratio(RATIO), allocate=named("omp", "uniform", "refit")[1], provider="cpu", round_to=1)
    (m32, r32), (m16, r16) = (compress(m, _calib(tiny), options) for m in (tiny.model, half))
    assert [(lr.group, lr.kept) for lr in r16.layers] == [(lr.group, lr.kept) for lr in r32.layers]
    weights = [t for t in m16.graph.initializer if len(t.dims) > 1]
    assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
    x = tiny.x[:16]
    y32, y16 = (run(m, input=x)[0] for m in (m32, m16))
    assert _rel(y16, y32) < 0.02 and _rel(run(half, input=x)[0], run(tiny.model, input=x)[0]) < 0.02
