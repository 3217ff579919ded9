"""Shortlisted global imitation and ``--method auto``: the search on synthetic losses (its plan, the exhaustive
case), the shortlist against the exhaustive search on a small network, auto's per-layer rule and its time
budget (a fake clock)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxprune import strategies
from onnxprune.analysis import analyze, consumers
from onnxprune.calib.sources import load_calibration
from onnxprune.strategies.downstream import ConsumerDownstream
from onnxprune.imitation.global_ import evaluations, plan, shortlisted_global, solve_flops
from onnxprune.pipeline import Compressor, compress, schedule
from onnxprune.ir.ort import model_input_specs
from onnxprune.tasks import raw_discrepancy
from onnxprune.strategies import global_search
from onnxprune.strategies import OMP, Auto, Global, MACs, TimeBudget, Uniform, options_from
from tests.onnx_builders import GraphBuilder, masked_original, run


class FakeRank:
    """Gains = fixed scores, the chosen at -inf."""

    def __init__(self, scores: np.ndarray) -> None:
        self.scores = np.asarray(scores, dtype=float).copy()

    def gains(self) -> np.ndarray:
        return self.scores.copy()

    def add(self, c: int) -> float:
        assert np.isfinite(self.scores[c])
        self.scores[c] = -np.inf
        return 0.0


def _pair_loss(n: int, seed: int):
    """A loss with interactions: D(S) = ||t - Σ_{i∈S} v_i||² over random vectors."""
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, 6))
    t = v[: n // 2].sum(0) + 0.3 * rng.standard_normal(6)
    calls = []

    def losses(supports, step):
        calls.append((len(supports), step))
        return np.array([np.sum((t - v[s].sum(0)) ** 2) for s in supports])

    return losses, calls, (lambda s: float(np.sum((t - v[list(s)].sum(0)) ** 2)))


@pytest.mark.parametrize(("n", "width", "steps", "shortlist"), [(10, 4, 8, 4), (20, 13, 4, 3), (9, 9, 2, 1),
                                                                 (30, 7, 1, 4)])
def test_the_search_takes_its_planned_steps(n: int, width: int, steps: int, shortlist: int) -> None:
    losses, calls, _ = _pair_loss(n, 0)
    rank = FakeRank(np.random.default_rng(1).random(n))
    path = shortlisted_global(rank, losses, n, width, steps=steps, shortlist=shortlist)
    m = -(-width // steps)
    assert len(path.order) == width == len(set(path.order.tolist()))
    assert path.taken.sum() == width and path.taken.max() == m
    assert int(path.evaluated.sum()) == evaluations(n, width, steps, shortlist) == sum(k for k, _ in calls)
    # each step evaluates max(shortlist, 2m) of the channels left, or none when they would all be taken
    left = n - np.concatenate([[0], np.cumsum(path.taken)[:-1]])
    expect = np.minimum(left, np.maximum(shortlist, 2 * path.taken))
    assert np.array_equal(path.evaluated, np.where(expect > path.taken, expect, 0))


@pytest.mark.parametrize(("n", "width", "steps", "shortlist"), [(10, 4, 8, 4), (20, 13, 4, 3), (30, 7, 1, 4)])
def test_solve_flops_counts_a_solve_per_candidate_and_consumer(n: int, width: int, steps: int, shortlist: int) -> None:
    """The solves' operation count from the plan equals the one from the supports the search really scores: a
    (|S|·k)-unknown LU solve with ``outputs`` right-hand sides for each candidate and consumer."""
    sizes: list[int] = []
    losses, _, _ = _pair_loss(n, 0)

    def recording(supports, step):
        sizes.extend(len(s) for s in supports)
        return losses(supports, step)

    shortlisted_global(FakeRank(np.random.default_rng(1).random(n)), recording, n, width, steps=steps,
                       shortlist=shortlist)
    shapes = [(9, 16), (1, 10)]
    expect = sum(2 / 3 * (s * k) ** 3 + 2 * (s * k) ** 2 * o for s in sizes for k, o in shapes)
    assert solve_flops(n, width, steps, shortlist, shapes) == pytest.approx(expect)


def test_exhaustive_search_is_the_greedy_over_every_channel() -> None:
    """steps = width and a shortlist of all channels: each step adds the channel of lowest loss, whatever the
    ranking says."""
    n, width = 12, 6
    losses, _, loss_of = _pair_loss(n, 3)
    path = shortlisted_global(FakeRank(-np.arange(n)), losses, n, width, steps=width, shortlist=n)
    chosen: list[int] = []
    for _ in range(width):
        rest = [c for c in range(n) if c not in chosen]
        chosen.append(min(rest, key=lambda c: loss_of([*chosen, c])))
    assert path.order.tolist() == chosen
    assert path.losses[-1] == pytest.approx(loss_of(chosen))


def test_a_step_takes_the_best_of_its_shortlist_only() -> None:
    """The ranking decides what is evaluated: a channel outside the shortlist never enters, however good."""
    n = 8
    losses, _, _ = _pair_loss(n, 5)
    scores = np.arange(n, dtype=float)[::-1]  # channel 0 ranked first ... channel 7 last
    path = shortlisted_global(FakeRank(scores), losses, n, 2, steps=2, shortlist=3)
    assert set(path.order[:1].tolist()) <= {0, 1, 2}


# ------------------------------------------------------------------------------------------ on a network


def _net(seed: int = 0) -> onnx.ModelProto:
    """conv a (3→12) → conv b (→16) → conv c (→12) → pool → Gemm (→10 logits): three groups."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]}, seed=seed)
    x = b.op("Relu", [b.conv("input", "a", 3, 12)], "ra")
    x = b.op("Relu", [b.conv(x, "b", 12, 16)], "rb")
    x = b.op("Relu", [b.conv(x, "c", 16, 12)], "rc")
    x = b.op("Flatten", [b.op("GlobalAveragePool", [x], "gap")], "flat")
    return b.model([b.gemm(x, "fc", 12, 10)])


def _calib(tmp_path: Path, model: onnx.ModelProto, n: int = 24):
    np.save(tmp_path / "c.npy", np.random.default_rng(0).standard_normal((n, 3, 8, 8)).astype(np.float32))
    return load_calibration(str(tmp_path / "c.npy"), model_input_specs(model))


def _compress(model, calib, select, widths=None):
    analysis = analyze(model)
    widths = widths or {"a": 6, "b": 9, "c": 5}
    target = analysis.macs.macs({g.id: widths.get(g.name, g.channels) for g in analysis.prunable})
    return compress(model, calib, options_from(MACs(target), select, Uniform(), round_to=1, provider="cpu"))


def _same(p: onnx.ModelProto, q: onnx.ModelProto) -> bool:
    x = np.random.default_rng(9).standard_normal((4, 3, 8, 8)).astype(np.float32)
    return all(np.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(run(p, input=x), run(q, input=x)))


def test_shortlisted_search_picks_what_the_exhaustive_search_picks_on_small_layers(tmp_path: Path) -> None:
    """On this network every channel the exhaustive search adds is among the OMP's 8 best at its step (the worst
    is 8th: a shortlist of 4 does change picks here), so a shortlist of 8 gives the same model with 158 evaluations
    instead of 214."""
    model = _net()
    calib = _calib(tmp_path, model)
    big = 1000
    exhaustive, rep_e = _compress(model, calib, Global(steps=big, shortlist=big))
    shortlisted, rep_s = _compress(model, calib, Global(steps=big, shortlist=8))
    for e, s in zip(rep_e.layers, rep_s.layers):  # every channel left at each step, or 8 of them
        assert e.selection["evaluations"] == sum(range(e.channels - e.kept + 1, e.channels + 1))
        assert s.selection["evaluations"] == sum(min(8, e.channels - k) for k in range(e.kept))
    assert sum(s.selection["evaluations"] for s in rep_s.layers) == 158 < 214 == sum(
        e.selection["evaluations"] for e in rep_e.layers)
    assert _same(exhaustive, shortlisted)
    omp, _ = _compress(model, calib, OMP())
    assert not _same(exhaustive, omp)  # the global criterion does pick other channels than OMP here


def _auto_compress(model, calib, monkeypatch, budget, clock=None, verdict=None):
    if verdict is not None:  # (omp, global) discrepancies the judge returns
        monkeypatch.setattr(global_search.Search, "judge", lambda self, keeps: np.array(verdict))
    kwargs = {} if clock is None else {"clock": clock}
    return _compress(model, calib, Auto(budget=budget, **kwargs))


@pytest.mark.parametrize("verdict", [(1.0, 2.0), (2.0, 1.0)], ids=["omp lower", "global lower"])
def test_auto_keeps_the_selection_with_the_lower_held_discrepancy(tmp_path: Path, monkeypatch, verdict) -> None:
    model = _net()
    calib = _calib(tmp_path, model)
    pruned, report = _auto_compress(model, calib, monkeypatch, 1e6, verdict=verdict)
    winner = "omp" if verdict[0] < verdict[1] else "global"
    assert [x.selection["method"] for x in report.layers] == [winner] * 3
    assert all((x.selection["omp"], x.selection["global"]) == verdict for x in report.layers)
    reference, _ = _compress(model, calib, OMP() if winner == "omp" else Global())
    assert _same(pruned, reference)  # what won is what was written


def test_auto_with_no_budget_is_omp(tmp_path: Path) -> None:
    model = _net()
    calib = _calib(tmp_path, model)
    pruned, report = _compress(model, calib, Auto(budget=0))
    assert all(x.selection == {"method": "omp", "why": "global not planned: the budget went to the groups nearer "
                                                        "the output"} for x in report.layers)
    assert report.selection["spent_s"] == 0
    assert _same(pruned, _compress(model, calib, OMP())[0])


class FakeClock:
    """Seconds that pass only as candidates are scored through the network after a cut: ``per_candidate`` each."""

    def __init__(self, monkeypatch, per_candidate: float) -> None:
        self.now = 0.0
        real = ConsumerDownstream.losses

        def losses(downstream, candidates, samples):
            self.now += per_candidate * len(candidates)
            return real(downstream, candidates, samples)

        monkeypatch.setattr(ConsumerDownstream, "losses", losses)

    def __call__(self) -> float:
        return self.now


def _predict(seconds: list[float]):
    """TimeBudget's predictions replaced by ``seconds``, in pruning order."""
    init = strategies.TimeBudget.__init__

    def patched(self, budget, predicted):
        init(self, budget, {g: s for g, s in zip(predicted, seconds)})
    return patched


def _true_seconds(model, calib, monkeypatch) -> list[float]:
    """Each group's fake seconds of a global attempt (its search and the judge), from an unbounded auto run."""
    _, report = _auto_compress(model, calib, monkeypatch, 1e9, clock=FakeClock(monkeypatch, 1.0))
    return [x.selection["seconds"] for x in report.layers]


def test_auto_spends_its_budget_nearest_the_output_first(tmp_path: Path, monkeypatch) -> None:
    """With exact predictions, a budget that holds the last two groups' attempts plans them and leaves the first
    one to omp; it spends exactly their seconds."""
    model = _net()
    calib = _calib(tmp_path, model)
    true = _true_seconds(model, calib, monkeypatch)
    monkeypatch.setattr(strategies.TimeBudget, "__init__", _predict(true))
    budget = true[1] + true[2] + 0.5
    _, report = _auto_compress(model, calib, monkeypatch, budget, clock=FakeClock(monkeypatch, 1.0))
    assert ["global" in x.selection for x in report.layers] == [False, True, True]
    assert report.layers[0].selection["why"].startswith("global not planned")
    assert report.selection["spent_s"] == pytest.approx(true[1] + true[2])


def test_auto_stops_a_search_when_its_share_of_the_budget_runs_out(tmp_path: Path, monkeypatch) -> None:
    """A prediction of half the real cost plans the last group, whose search is stopped once its share (the whole
    budget, nothing planned after it) is spent: omp's choice is written and the overrun is less than one step."""
    model = _net()
    calib = _calib(tmp_path, model)
    true = _true_seconds(model, calib, monkeypatch)
    monkeypatch.setattr(strategies.TimeBudget, "__init__", _predict([1e9, 1e9, true[2] / 2]))
    budget = 0.75 * true[2]
    pruned, report = _auto_compress(model, calib, monkeypatch, budget, clock=FakeClock(monkeypatch, 1.0))
    last = report.layers[2].selection
    assert last["method"] == "omp" and last["why"].startswith("global stopped at step ")
    assert last["why"].endswith(f"its {budget:.1f} s of the budget ran out")
    step = max(size for _, size in plan(12, 5, 8, 4))  # the last group's widest step: 12 channels kept to 5
    assert budget < report.selection["spent_s"] <= budget + step
    assert _same(pruned, _compress(model, calib, OMP())[0])


def test_time_budget_plans_from_the_output_and_skips_what_no_longer_fits() -> None:
    t = TimeBudget(30.0, {1: 20.0, 2: 10.0, 3: 5.0, 4: 10.0})  # in pruning order: 4 is nearest the output
    assert t.plan == [4, 3, 2]  # 10 + 5 + 10 = 25 <= 30; group 1 (20 s) no longer fits
    assert t.allows(1).startswith("global not planned")
    assert t.allows(2) is None
    assert (t.share(2), t.share(3), t.share(4)) == (15.0, 20.0, 30.0)  # the later planned groups' time is reserved
    t.spend(2, 20.0)  # took twice its prediction: later predictions double
    assert t.scale == 2.0
    assert t.allows(3) == "global skipped: predicted 10.0 s (+20.0 s planned later) > 10.0 s left"
    assert t.allows(4) == "global skipped: predicted 20.0 s (+0.0 s planned later) > 10.0 s left"
    t.spend(4, 5.0)
    assert t.spent == 25.0 and t.scale == pytest.approx(25.0 / 20.0)
    t.spend(3, 4.0, finished=False)  # a stopped search counts its seconds but says nothing of the predictions
    assert t.spent == 29.0 and t.scale == pytest.approx(25.0 / 20.0)


def test_global_imitation_shows_its_steps(tmp_path: Path) -> None:
    model = _net()
    calib = _calib(tmp_path, model)
    analysis = analyze(model)
    target = analysis.macs.macs({g.id: g.channels // 2 for g in analysis.prunable})
    labels = []
    compress(model, calib, options_from(MACs(target), Global(steps=3), Uniform(), round_to=1, provider="cpu"),
             on_layer=lambda i, total, label: labels.append(label))
    steps = [x for x in labels if "global imitation" in x]
    assert steps[:3] == [f"pruning a: global imitation, step {k}/3 ({n} candidates)" for k, n in ((1, 4), (2, 4), (3, 4))]


def test_candidate_weights_score_as_the_masked_network_does(tmp_path: Path) -> None:
    """ConsumerDownstream feeds a candidate's consumer weights to the network after the cut: consumer columns of
    a ranged group (two convs concatenated) scaled by a mask score exactly as the original network with those
    channels masked, run whole; the unchanged weights score 0."""
    b = GraphBuilder({"input": ["N", 3, 8, 8]}, seed=2)
    cat = b.op("Concat", [b.conv("input", "a", 3, 6), b.conv("input", "b", 3, 5)], "cat", axis=1)
    x = b.op("Relu", [b.conv(b.op("Relu", [cat], "r"), "c", 11, 8)], "rc")
    model = b.model([b.gemm(b.op("Flatten", [b.op("GlobalAveragePool", [x], "gap")], "flat"), "fc", 8, 10)])
    calib = _calib(tmp_path, model, 8)
    run_ = Compressor(model, calib, options_from(MACs(1.0), provider="cpu"))
    order, _ = schedule(run_.analysis, run_.live)
    cut, group = next((cut, g) for cut, g in order if g.name == "b")
    assert group.partial
    run_.advance(run_.graph, run_.values_p, cut)
    downstream = ConsumerDownstream(run_.graph, run_.values_p, ["c"], run_.reference_outputs(), provider="cpu")
    node = next(n for n in run_.graph.nodes if n.name == "c")
    full = consumers.matrix(node)
    cols = consumers.group_view(run_.graph, node, group, group.consumers[0]).cols
    mask = np.array([0.0, 1.5, 1.0, 0.0, 0.7])
    weight = full.weight.copy()
    weight[:, cols] *= np.repeat(mask, full.k)
    everything = downstream.samples(np.arange(8))
    scores = downstream.losses([[full], [consumers.Linear(weight, full.bias, full.k)]], everything)
    masked = run(masked_original(run_.original, group, mask), input=np.concatenate(
        [batch["input"] for batch in calib.batches(8)]))
    reference = run(model, input=np.concatenate([batch["input"] for batch in calib.batches(8)]))
    assert scores[0] == pytest.approx(0.0, abs=1e-9)
    assert scores[1] == pytest.approx(raw_discrepancy([{"fc_out": reference[0]}], [{"fc_out": masked[0]}]),
                                      rel=1e-4)
    assert scores[1] > 1e-3  # the mask matters
