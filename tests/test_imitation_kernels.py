"""Numerical kernels of local imitation: streamed stats, neuron quadratics, greedy, refit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from onnxprune.imitation import refit
from onnxprune.imitation import gram as gram_mod
from onnxprune.imitation.local import greedy_local, loss
from onnxprune.imitation.refit import (
    expand_channels,
    quadratic_loss_full,
    refit_cv,
    refit_full,
    refit_scale,
    centred_energy,
)
from onnxprune.imitation.gram import ConsumerStats, neuron_cross, neuron_gram, target_energy

# ---------------------------------------------------------------- helpers


def neuron_outputs(x: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """h[p, i] = W[:, iK:(i+1)K] @ x_p[iK:(i+1)K], shape (P, N, O), materialised."""
    p, d = x.shape
    return np.einsum("pnk,onk->pno", x.reshape(p, d // k, k), w.reshape(len(w), d // k, k))


def stats_of(x: np.ndarray, t: np.ndarray) -> ConsumerStats:
    """ConsumerStats over all rows of x, t."""
    s = ConsumerStats(x.shape[1], t.shape[1])
    s.update(x, t)
    return s


def exact_integer_data(
    rng: np.random.Generator, p: int, d: int, o: int, offset: int = 0
) -> tuple[np.ndarray, ...]:
    """x, W, b, t = W x + b with small dyadic values, so float32 stats are exact."""
    x = rng.integers(-2 + offset, 3 + offset, size=(p, d)).astype(np.float32)
    w = rng.integers(-8, 9, size=(o, d)) / 8.0
    b = rng.integers(-8, 9, size=o) / 8.0
    t = (x.astype(np.float64) @ w.T + b).astype(np.float32)
    return x, w, b, t


def greedy_problem(rng: np.random.Generator, n: int, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Neuron outputs H (p, n) and the paper's target: G = HᵀH, c = G1/N, tau = 1ᵀG1/N²."""
    h = rng.standard_normal((p, n)) + 0.3
    g = h.T @ h
    return h, g, g.sum(1) / n, float(g.sum()) / n**2


def line_min(G: np.ndarray, c: np.ndarray, tau: float, a: np.ndarray, grid: int = 2001) -> float:
    """min over i and γ in U_i of L((1-γ)a + γe_i), by direct evaluation of `loss` on a γ-grid
    plus the vertex of the parabola through γ = -1, 0, 1 (clipped to U_i)."""
    best = np.inf
    for i in range(len(a)):
        e = np.zeros_like(a)
        e[i] = 1.0
        lo = -a[i] / (1 - a[i]) if 0 < a[i] < 1 else 0.0
        v_m, v_0, v_p = (loss(G, c, tau, (1 - gam) * a + gam * e) for gam in (-1.0, 0.0, 1.0))
        curv = (v_p + v_m) / 2 - v_0
        vertex = (v_m - v_p) / (4 * curv) if curv > 0 else 0.0
        for gam in np.append(np.linspace(lo, 1.0, grid), np.clip(vertex, lo, 1.0)):
            best = min(best, loss(G, c, tau, (1 - gam) * a + gam * e))
    return best


def step_of(before: np.ndarray, after: np.ndarray) -> tuple[int, float]:
    """(i, γ) with after = (1-γ)·before + γ·e_i, or raise AssertionError."""
    for i in range(len(before)):
        if before[i] < 1:
            gam = (after[i] - before[i]) / (1 - before[i])
            e = np.zeros_like(before)
            e[i] = 1.0
            if np.allclose(after, (1 - gam) * before + gam * e, rtol=0, atol=1e-12) and gam != 0:
                return i, gam
    raise AssertionError("not a single greedy step")


def assert_simplex(a: np.ndarray) -> None:
    assert np.all(a >= 0)
    assert abs(a.sum() - 1.0) <= 1e-12


# ---------------------------------------------------------------- stats


def test_consumer_stats_matches_float64_over_chunks() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40000, 12)) + 0.5).astype(np.float32)  # > 2 chunks
    t = rng.standard_normal((40000, 5)).astype(np.float32)
    s = stats_of(x, t)
    x64, t64 = x.astype(np.float64), t.astype(np.float64)
    for got, want in [(s.xx, x64.T @ x64), (s.xt, x64.T @ t64), (s.sx, x64.sum(0)), (s.st, t64.sum(0))]:
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert s.tt == pytest.approx(float((t64**2).sum()), rel=1e-6)  # float32 chunk products
    assert s.count == 40000


@pytest.mark.parametrize("d", [255, 256, 257, 600])  # the products' row blocks (GRAM_ROWS) and their edges
def test_consumer_stats_in_row_blocks_match_float64_and_are_symmetric(d: int) -> None:
    rng = np.random.default_rng(d)
    x = (rng.standard_normal((900, d)) + rng.choice([0.0, 30.0], d)).astype(np.float32)  # some columns shifted
    t = rng.standard_normal((900, 3)).astype(np.float32)
    s = stats_of(x[:400], t[:400])
    s.merge(stats_of(x[400:], t[400:]))
    x64, t64 = x.astype(np.float64), t.astype(np.float64)
    for got, want in [(s.xx, x64.T @ x64), (s.xt, x64.T @ t64), (s.sx, x64.sum(0)), (s.st, t64.sum(0))]:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert s.tt == pytest.approx(float((t64**2).sum()), rel=1e-6)
    np.testing.assert_array_equal(s.xx, s.xx.T)


@pytest.mark.parametrize("d", [3, 256, 600])
def test_moved_sums_in_row_blocks_equal_the_whole_products(d: int) -> None:
    rng = np.random.default_rng(d)
    xx, xt, sx, st, dx, dt = (torch.from_numpy(rng.standard_normal(shape)) for shape in
                              [(d, d), (d, 4), (d,), (4,), (d,), (4,)])
    tt = torch.tensor(2.0, dtype=torch.float64)
    want = xx + torch.outer(dx, sx) + torch.outer(sx, dx) + 37 * torch.outer(dx, dx)
    assert torch.equal(gram_mod._moved((xx, xt, sx, st, tt), 37, dx, dt)[0], want)


def test_consumer_stats_torch_numpy_and_merge_agree() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3000, 7)).astype(np.float32)
    t = rng.standard_normal((3000, 3)).astype(np.float32)
    whole = stats_of(x, t)
    first = stats_of(torch.from_numpy(x[:1000]), torch.from_numpy(t[:1000]))
    second = stats_of(x[1000:].astype(np.float64), t[1000:])  # float64 input is cast to float32
    first.merge(second)
    for name in ("xx", "xt", "sx", "st"):
        want = getattr(whole, name)  # float32 chunk sums: equal up to float32 rounding of Σ|x x|
        np.testing.assert_allclose(getattr(first, name), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    assert first.tt == pytest.approx(whole.tt, rel=1e-6)
    assert first.count == whole.count


def test_folds_merged_into_an_empty_accumulator_are_copied_then_added_in_place() -> None:
    """The merged statistics of the refit's two folds: the first fold's sums taken as they are (no zeros allocated
    and added: a D×D array is fresh memory each time), the second added in place; the folds stay as they were."""
    rng = np.random.default_rng(3)
    folds = [stats_of(*(rng.standard_normal((500, w)).astype(np.float32) for w in (6, 2))) for _ in range(2)]
    before = [[getattr(f, name).copy() for name in ("xx", "xt", "sx", "st")] for f in folds]
    merged = ConsumerStats(6, 2)
    for fold in folds:
        merged.merge(fold)
    for f, sums in zip(folds, before):  # not aliased: the in-place add left the first fold alone
        for name, want in zip(("xx", "xt", "sx", "st"), sums):
            np.testing.assert_array_equal(getattr(f, name), want)
    for name, (a, b) in zip(("xx", "xt", "sx", "st"), zip(*before)):
        np.testing.assert_array_equal(getattr(merged, name), a + b)  # 0 + a + b, to the bit
    assert merged.tt == folds[0].tt + folds[1].tt and merged.count == 1000


@pytest.mark.parametrize("length", [7, 5000])  # both the batched-copy and the per-image paths
def test_consumer_stats_channel_major_equals_rows(length: int) -> None:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 6, length)).astype(np.float32)
    t = rng.standard_normal((3, 4, length)).astype(np.float32)
    cm = ConsumerStats(6, 4)
    cm.update(torch.from_numpy(x), torch.from_numpy(t))
    rows = stats_of(x.transpose(0, 2, 1).reshape(-1, 6), t.transpose(0, 2, 1).reshape(-1, 4))
    for name in ("xx", "xt", "sx", "st"):
        np.testing.assert_allclose(getattr(cm, name), getattr(rows, name), rtol=1e-5, atol=1e-4)
    assert cm.tt == pytest.approx(rows.tt, rel=1e-6)
    assert cm.count == rows.count == 3 * length


def test_consumer_stats_rejects_bad_shapes() -> None:
    s = ConsumerStats(4, 2)
    with pytest.raises(ValueError):
        s.update(np.zeros((5, 3), np.float32), np.zeros((5, 2), np.float32))
    with pytest.raises(ValueError):
        s.update(np.zeros((5, 4), np.float32), np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError):
        s.merge(ConsumerStats(4, 3))


@pytest.mark.parametrize("k", [1, 9])
def test_neuron_gram_and_cross_match_materialised_contributions(k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gram_mod, "_BLOCK_ELEMENTS", 200)  # force several row blocks
    rng = np.random.default_rng(k)
    n, o, p = 6, 4, 300
    x = rng.standard_normal((p, n * k))
    w = rng.standard_normal((o, n * k))
    bias = rng.standard_normal(o)
    t = rng.standard_normal((p, o)) + bias
    h = neuron_outputs(x, w, k)
    g = neuron_gram(x.T @ x, w, k)
    np.testing.assert_allclose(g, np.einsum("pio,pjo->ij", h, h), rtol=1e-10, atol=1e-9)
    c = neuron_cross(x.T @ t, x.sum(0), w, k, bias)
    np.testing.assert_allclose(c, np.einsum("pio,po->i", h, t - bias), rtol=1e-10, atol=1e-9)
    np.testing.assert_allclose(neuron_cross(x.T @ t, x.sum(0), w, k), np.einsum("pio,po->i", h, t), rtol=1e-10)
    energy = target_energy(float((t**2).sum()), t.sum(0), p, bias)
    assert energy == pytest.approx(float(((t - bias) ** 2).sum()), rel=1e-12)


# ---------------------------------------------------------------- greedy local imitation


def test_greedy_steps_are_exhaustive_argmins() -> None:
    rng = np.random.default_rng(2)
    h, G, _, _ = greedy_problem(rng, 5, 12)
    f = h.mean(1) + 0.05 * rng.standard_normal(12)  # a target off the convex hull: min loss > 0
    c, tau = h.T @ f, float(f @ f)
    first = greedy_local(G, c, tau, max_steps=0)
    assert first.final[np.argmin(np.diag(G) - 2 * c)] == 1.0
    prev, steps = first, 0
    for k in range(1, 11):
        path = greedy_local(G, c, tau, max_steps=k)
        np.testing.assert_array_equal(path.losses[:-1], prev.losses)
        assert path.losses[-1] == pytest.approx(loss(G, c, tau, path.final), abs=1e-12)
        assert abs(path.losses[-1] - line_min(G, c, tau, prev.final)) <= 1e-9
        i, gam = step_of(prev.final, path.final)
        lo = -prev.final[i] / (1 - prev.final[i])
        assert lo - 1e-12 <= gam <= 1.0
        assert_simplex(path.final)
        steps += 1
        prev = path
    assert steps == 10


def test_greedy_removal_step_is_optimal_and_exact() -> None:
    # A 4-neuron instance (found by search) whose third step removes a neuron picked earlier.
    rng = np.random.default_rng(28)
    n, p = int(rng.integers(3, 6)), int(rng.integers(2, 5))
    h = rng.standard_normal((p, n))
    f = 0.5 * rng.standard_normal(p)
    G, c, tau = h.T @ h, h.T @ f, float(f @ f)
    before = greedy_local(G, c, tau, max_steps=2)
    after = greedy_local(G, c, tau, max_steps=3)
    assert before.supports[-1] == 3 and after.supports[-1] == 2
    removed, gam = step_of(before.final, after.final)
    assert before.final[removed] > 0 and after.final[removed] == 0.0
    assert gam == pytest.approx(-before.final[removed] / (1 - before.final[removed]), rel=1e-12)
    assert after.losses[-1] <= line_min(G, c, tau, before.final) + 1e-12
    assert_simplex(after.final)
    np.testing.assert_array_equal(after.weights(2), after.final)


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 12), paper_target=st.booleans())
def test_greedy_invariants(seed: int, n: int, paper_target: bool) -> None:
    rng = np.random.default_rng(seed)
    h, G, c, tau = greedy_problem(rng, n, int(rng.integers(1, 2 * n)))  # possibly rank-deficient
    if not paper_target:
        f = h @ rng.random(n) * 1.5 + rng.standard_normal(len(h))
        c, tau = h.T @ f, float(f @ f)
    path = greedy_local(G, c, tau)
    scale = path.losses[0] + 1e-300
    assert np.all(np.diff(path.losses) <= 1e-12 * scale)
    assert np.all(np.abs(np.diff(path.supports)) <= 1)
    assert path.supports[0] == 1 and path.losses[0] == pytest.approx(np.min(np.diag(G) - 2 * c) + tau)
    assert path.order[0] == np.argmin(np.diag(G) - 2 * c)
    assert len(set(path.order.tolist())) == len(path.order)
    assert_simplex(path.final)
    for m in range(1, n + 1):
        a = path.weights(m)
        assert_simplex(a)
        chosen = path.support(m)
        assert len(chosen) == m and len(np.unique(chosen)) == m
        assert set(np.flatnonzero(a)) <= set(chosen.tolist())
        if path.padded(m):
            assert np.count_nonzero(a) < m
        else:
            assert np.count_nonzero(a) == m
            assert loss(G, c, tau, a) == pytest.approx(path.curve[m], abs=1e-10 * scale)


def test_greedy_paper_target_converges_to_uniform() -> None:
    rng = np.random.default_rng(3)
    n = 30
    _, G, c, tau = greedy_problem(rng, n, 8 * n)
    path = greedy_local(G, c, tau, max_steps=40 * n)
    assert np.isfinite(path.curve[n]) and not path.padded(n)
    assert path.curve[n] <= 1e-8 * path.curve[1]
    assert path.curve[n // 2] < 0.1 * path.curve[1]
    np.testing.assert_allclose(path.weights(n), np.full(n, 1 / n), atol=1e-4)
    finite = path.curve[np.isfinite(path.curve)]
    assert np.all(np.diff(finite[: n // 2]) < 0)  # more neurons, lower loss


def test_greedy_plateau_pads_with_unselected_channels() -> None:
    rng = np.random.default_rng(4)
    h = rng.standard_normal((20, 4))
    h = np.concatenate([h, h], axis=1)  # exact duplicates: loss 0 is reachable with <= 4 neurons
    G = h.T @ h
    c, tau = G.sum(1) / 8, float(G.sum()) / 64
    path = greedy_local(G, c, tau)
    top = int(path.supports.max())
    assert top <= 4 and path.losses[-1] <= 1e-10 * path.losses[0]
    assert path.padded(8) and not path.padded(top)
    np.testing.assert_array_equal(path.weights(8), path.weights(top))
    np.testing.assert_array_equal(path.support(8), np.arange(8))
    with pytest.raises(ValueError):
        path.weights(9)


# ---------------------------------------------------------------- refit


def test_expand_channels() -> None:
    np.testing.assert_array_equal(expand_channels(np.array([2, 0]), 3), [6, 7, 8, 0, 1, 2])


def test_refit_full_recovers_a_linear_consumer() -> None:
    x, w, b, t = exact_integer_data(np.random.default_rng(5), 2000, 8, 3)
    s = stats_of(x, t)
    w_new, b_new = refit_full(s, np.arange(8), ridge=0.0)
    np.testing.assert_allclose(w_new, w, rtol=1e-6, atol=1e-6 * np.abs(w).max())
    np.testing.assert_allclose(b_new, b, rtol=1e-6, atol=1e-6 * np.abs(b).max())
    assert quadratic_loss_full(s, np.arange(8), w, b) == pytest.approx(0.0, abs=1e-9 * s.tt)
    w_r, _ = refit_full(s, np.arange(8))  # default ridge barely moves an exact fit
    np.testing.assert_allclose(w_r, w, atol=1e-3)


@pytest.mark.parametrize("ridge", [0.0, 1e-2])
def test_refit_full_on_subset_is_the_least_squares_optimum(ridge: float) -> None:
    x, w, b, t = exact_integer_data(np.random.default_rng(6), 1500, 8, 3, offset=1)  # non-centred x
    keep = np.array([5, 0, 3, 6])
    s = stats_of(x, t)
    w_new, b_new = refit_full(s, keep, ridge=ridge)
    xs = x[:, keep].astype(np.float64)
    lam = ridge * float((xs**2).sum()) / len(keep)
    ridge_rows = np.hstack([np.sqrt(lam) * np.eye(4), np.zeros((4, 1))])  # bias not penalised
    design = np.vstack([np.hstack([xs, np.ones((len(xs), 1))]), ridge_rows])
    target = np.vstack([t.astype(np.float64), np.zeros((4, 3))])
    sol = np.linalg.lstsq(design, target, rcond=None)[0]
    np.testing.assert_allclose(w_new, sol[:4].T, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(b_new, sol[4], rtol=1e-8, atol=1e-8)
    direct = float(((xs @ w_new.T + b_new - t) ** 2).sum())
    assert quadratic_loss_full(s, keep, w_new, b_new) == pytest.approx(direct, rel=1e-9)
    variance = float(((t - t.mean(0, dtype=np.float64)) ** 2).sum())
    assert quadratic_loss_full(s, keep, w_new, b_new) / centred_energy(s) == pytest.approx(direct / variance, rel=1e-9)


def ridge_optimum(x: np.ndarray, t: np.ndarray, ridge: float, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``refit_full``'s problem solved directly in float64: centred normal equations, λ = ridge·tr(xᵀx)/(|S|·P)."""
    x, t = x.astype(np.float64), t.astype(np.float64)
    xc, tc = x - x.mean(0), t - t.mean(0)
    lam = ridge * float((x**2).sum()) / x.size
    w = np.linalg.solve(xc.T @ xc / len(x) + lam * np.eye(x.shape[1]), xc.T @ tc / len(x) + lam * prior.T).T
    return w, t.mean(0) - w @ x.mean(0)


def test_refit_with_fewer_positions_than_columns_solves_in_their_space() -> None:
    rng = np.random.default_rng(8)
    x, _, _, t = exact_integer_data(rng, 30, 48, 5, offset=2)
    s = ConsumerStats(48, 5)
    s.update(x[:10], t[:10])
    s.update(x[10:], t[10:])
    np.testing.assert_array_equal(s.rows[0], x)  # 30 positions < 48 columns: kept, in order
    keep, prior = np.arange(3, 43), rng.normal(size=(5, 40))
    for ridge in (1e-4, 1.0):
        w, b = refit_full(s, keep, ridge, prior)
        want_w, want_b = ridge_optimum(x[:, keep], t, ridge, prior)
        np.testing.assert_allclose(w, want_w, rtol=1e-9, atol=1e-9 * np.abs(want_w).max())
        np.testing.assert_allclose(b, want_b, rtol=1e-9, atol=1e-9 * np.abs(want_b).max())
    s.update(x[:20], t[:20])  # 50 positions: past the columns, the rows are dropped and the Gram serves
    assert s.rows is None and s.count == 50


def test_refit_cv_is_the_same_from_positions_and_from_the_gram() -> None:
    rng = np.random.default_rng(9)
    x, _, _, t = exact_integer_data(rng, 40, 48, 5, offset=1)
    t = t + rng.integers(-4, 5, size=t.shape).astype(np.float32)  # noise: the ridges score differently
    folds = [stats_of(x[:20], t[:20]), stats_of(x[20:], t[20:])]
    keep, prior = np.arange(40), rng.integers(-8, 9, size=(5, 40)) / 8.0
    w, b, ridge = refit_cv(folds, keep, prior)
    assert folds[0].rows is not None
    for f in folds:  # the same sums (exact: small dyadic values), the Gram's route
        f._rows = None
    w_gram, b_gram, ridge_gram = refit_cv(folds, keep, prior)
    assert ridge == ridge_gram
    np.testing.assert_allclose(w, w_gram, rtol=1e-7, atol=1e-7 * np.abs(w_gram).max())
    np.testing.assert_allclose(b, b_gram, rtol=1e-7, atol=1e-7 * np.abs(b_gram).max())


@pytest.mark.parametrize("n", [1, 2, 3, 6, 7])
def test_the_descent_finds_the_first_least_score_of_one_minimum_asking_few(n: int) -> None:
    for low in range(n):
        for plateau in range(1, n - low + 1):  # scores equal at low … low + plateau - 1, rising on both sides
            scores = [abs(i - low) if i < low else max(0, i - (low + plateau - 1)) for i in range(n)]
            asked = set()

            def score(i: int, scores: list[int] = scores, asked: set[int] = asked) -> float:
                asked.add(i)
                return float(scores[i])

            assert refit._descend(score, n) == int(np.argmin(scores)), (scores, refit._descend(score, n))
            assert len(asked) <= max(n // 2 + 1, n - n // 2 + 1)
    assert refit.DESCENT_SCORES == 4 and refit.CV_SOLVES == 9


def test_refit_cv_picks_the_ridge_of_the_least_held_out_loss_over_the_grid() -> None:
    chosen = set()
    for seed, noise in enumerate((0.01, 0.5, 3.0, 20.0)):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((40, 30)).astype(np.float32)
        t = (x @ rng.standard_normal((30, 4)) + noise * rng.standard_normal((40, 4))).astype(np.float32)
        folds = (stats_of(x[:20], t[:20]), stats_of(x[20:], t[20:]))
        keep, prior = np.arange(30), rng.standard_normal((4, 30))
        scores = [sum(quadratic_loss_full(held, keep, *refit_full(fit, keep, r, prior=prior))
                      for fit, held in (folds, folds[::-1])) for r in refit.RIDGE_GRID]
        ridge = refit_cv(folds, keep, prior)[2]
        assert ridge == refit.RIDGE_GRID[int(np.argmin(scores))]
        chosen.add(ridge)
    assert len(chosen) >= 3  # the least loss sits at different places along the grid


@pytest.mark.parametrize("shape", [(1, 1), (70, 5000), (5000, 3), (300, 300)])
def test_subtract_outer_in_blocks_equals_the_outer_product(shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(2)
    a, u, v = rng.standard_normal(shape), rng.standard_normal(shape[0]), rng.standard_normal(shape[1])
    want = a - np.outer(u, v)
    np.testing.assert_array_equal(gram_mod.subtract_outer(a, u, v), want)
    np.testing.assert_array_equal(a, want)  # in place


@pytest.mark.parametrize("d", [1, 7, 256, 600])
def test_symmetrize_in_blocks_equals_the_mean_with_the_transpose(d: int) -> None:
    a = np.random.default_rng(3).standard_normal((d, d))
    want = (a + a.T) / 2
    np.testing.assert_array_equal(gram_mod.symmetrize(a, block=256), want)
    np.testing.assert_array_equal(a, want)  # in place


def test_held_out_losses_from_the_kernel_equal_fitting_and_scoring_each_ridge() -> None:
    rng = np.random.default_rng(11)
    x, t = rng.standard_normal((24, 60)), rng.standard_normal((24, 5))
    fit = stats_of(x[:12], t[:12])
    keep, prior = np.arange(3, 57), rng.standard_normal((5, 54))
    dual = refit._fitter(fit, keep, prior)
    assert isinstance(dual, refit._Dual) and dual.kernel_cheaper(12, len(refit.RIDGE_GRID))
    xh, th = x[12:, keep].astype(np.float32).astype(np.float64), t[12:].astype(np.float32).astype(np.float64)
    want = [np.sum(np.square(xh @ w.T + b - th)) for w, b in map(dual, refit.RIDGE_GRID)]
    np.testing.assert_allclose(dual.held_losses(xh, th, refit.RIDGE_GRID), want, rtol=1e-9)
    assert len(set(np.round(want, 6))) == len(want)  # the ridges differ: a loss taken at the wrong ridge shows


def test_refit_ordering_full_scale_unscaled() -> None:
    rng = np.random.default_rng(7)
    n, k, o, p = 6, 3, 4, 3000
    x = (rng.standard_normal((p, n * k)) + 0.5).astype(np.float32)
    w = rng.standard_normal((o, n * k))
    b = rng.standard_normal(o)
    t = (x.astype(np.float64) @ w.T + b + 0.1 * rng.standard_normal((p, o))).astype(np.float32)
    s = stats_of(x, t)
    keep = np.array([1, 4, 5])
    cols = expand_channels(keep, k)
    G = neuron_gram(s.xx, w, k)
    c = neuron_cross(s.xt, s.sx, w, k, b)
    scale = refit_scale(G[np.ix_(keep, keep)], c[keep], ridge=0.0)
    h = neuron_outputs(x.astype(np.float64), w, k)[:, keep]  # (P, |S|, O)
    want = np.linalg.lstsq(h.transpose(0, 2, 1).reshape(-1, len(keep)), (t - b).ravel(), rcond=None)[0]
    np.testing.assert_allclose(scale, want, rtol=1e-6)
    w_full, b_full = refit_full(s, cols, ridge=0.0)
    full = quadratic_loss_full(s, cols, w_full, b_full)
    scaled = quadratic_loss_full(s, cols, w[:, cols] * np.repeat(scale, k), b)
    unscaled = quadratic_loss_full(s, cols, w[:, cols], b)
    assert full <= scaled <= unscaled
    assert full < 0.99 * unscaled
    g_s = G[np.ix_(keep, keep)]
    lam = 0.1 * np.trace(g_s) / len(keep)
    np.testing.assert_allclose(
        refit_scale(g_s, c[keep], ridge=0.1), np.linalg.solve(g_s + lam * np.eye(len(keep)), c[keep]), rtol=1e-12
    )


@pytest.mark.parametrize("offset", [0.0, 1e3, 1e4])
def test_omp_losses_stay_exact_and_non_negative_when_the_mean_dwarfs_the_spread(offset: float) -> None:
    """Inputs of mean ``offset`` and spread 0.01..1 (an unfolded BatchNorm's input, raw pixels): the streamed
    statistics keep their variance, so the greedy's losses match those of exact float64 statistics (before the
    shift they went negative: -907 at 1e3)."""
    from onnxprune.imitation.omp import RIDGE, centred, group_omp, stats_omp
    rng = np.random.default_rng(0)
    x = (offset + rng.standard_normal((100_000, 16)) * np.linspace(0.01, 1, 16)).astype(np.float32)
    w = rng.standard_normal((8, 16)).astype(np.float32)
    t = x @ w.T
    s = ConsumerStats(16, 8)
    for i in range(0, len(x), 20_000):
        s.update(x[i:i + 20_000], t[i:i + 20_000])
    path = stats_omp([s], [1], 16)
    x64, t64 = x.astype(np.float64) - offset, t.astype(np.float64)  # centring is exact on the shifted data
    a, b, e = centred(x64.T @ x64, x64.T @ t64, x64.sum(0), t64.sum(0), float((t64 ** 2).sum()), len(x))
    exact = group_omp([a], [b], [e], [1], 16, ridge=RIDGE)
    assert (path.curve >= 0).all()
    np.testing.assert_allclose(path.curve[:8], exact.curve[:8], rtol=1e-3, atol=1e-6 * exact.curve[0])


def test_merged_statistics_of_different_shifts_equal_one_stream() -> None:
    rng = np.random.default_rng(1)
    x = (500 + rng.standard_normal((4000, 6))).astype(np.float32)
    t = (x @ rng.standard_normal((6, 3))).astype(np.float32)
    first, second, whole = ConsumerStats(6, 3), ConsumerStats(6, 3), ConsumerStats(6, 3)
    first.update(x[:1000], t[:1000])
    second.update(x[1000:] + 3, t[1000:] - 2)  # another shift
    whole.update(np.concatenate([x[:1000], x[1000:] + 3]), np.concatenate([t[:1000], t[1000:] - 2]))
    first.merge(second)
    for name in ("xx", "xt", "sx", "st", "tt"):
        np.testing.assert_allclose(getattr(first, name), getattr(whole, name), rtol=1e-6)
    assert first.count == whole.count


def test_chunks_built_in_one_scratch_give_the_same_sums() -> None:
    """``update`` with a ``Scratch`` builds every chunk's GEMM operand in one buffer (reused while it fits, replaced
    when a larger chunk comes) and accumulates exactly the sums of fresh buffers."""
    rng = np.random.default_rng(3)
    chunks = [(rng.standard_normal((b, 6, 50)).astype(np.float32), rng.standard_normal((b, 4, 50)).astype(np.float32))
              for b in (2, 1, 3)]
    fresh, reused, scratch = ConsumerStats(6, 4), ConsumerStats(6, 4), gram_mod.Scratch()
    buffers = []
    for x, t in chunks:
        fresh.update(x, t)
        reused.update(x, t, scratch)
        buffers.append(scratch._buffer)
    assert buffers[0] is buffers[1] and buffers[2] is not buffers[1]  # the second chunk fits the first's, the third not
    for name in ("xx", "xt", "sx", "st", "tt"):
        np.testing.assert_array_equal(getattr(reused, name), getattr(fresh, name))
