"""Group OMP over channels (onnxprune.imitation.omp) against direct least-squares solves."""

from __future__ import annotations

import numpy as np
import pytest

from onnxprune.imitation.omp import (
    GroupOmp,
    OmpPath,
    _path,
    centred,
    group_omp,
    narrow_cross,
    path_work,
    stats_omp,
    stats_omp_state,
)
from onnxprune.imitation.gram import ConsumerStats
from onnxprune.imitation.refit import expand_channels

# ---------------------------------------------------------------- helpers


def sample_stats(
    rng: np.random.Generator, n: int, k: int, o: int, p: int = 400
) -> tuple[np.ndarray, np.ndarray, float]:
    """Centred statistics of correlated random inputs (P, N·k) and random linear targets (P, O)
    plus noise, so that no subset explains the targets exactly."""
    d = n * k
    x = rng.standard_normal((p, d)) @ (np.eye(d) + 0.3 * rng.standard_normal((d, d)))
    t = x @ rng.standard_normal((d, o)) + rng.standard_normal((p, o)) + 2.0
    return explicit_stats(x, t)


def explicit_stats(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-position centred (A, B, e) computed directly from samples."""
    xc, tc = x - x.mean(0), t - t.mean(0)
    p = len(x)
    return xc.T @ xc / p, xc.T @ tc / p, float(np.sum(tc * tc) / p)


def direct_loss(
    a: np.ndarray, b: np.ndarray, e: float, k: int, keep: np.ndarray, ridge: float
) -> float:
    """e - tr(B[C]ᵀ (A[C,C] + λI)^{-1} B[C]) with C = cols(keep), λ = ridge·tr(A)/D."""
    if len(keep) == 0:
        return e
    cols = expand_channels(np.asarray(keep), k)
    g = a[np.ix_(cols, cols)] + ridge * np.trace(a) / len(a) * np.eye(len(cols))
    return e - float(np.trace(b[cols].T @ np.linalg.solve(g, b[cols])))


def total_direct(stats: list, ks: list[int], keep: np.ndarray, ridge: float) -> float:
    return sum(direct_loss(a, b, e, k, keep, ridge) for (a, b, e), k in zip(stats, ks))


def run(stats: list, ks: list[int], width: int, ridge: float = 1e-6) -> OmpPath:
    a, b, e = zip(*stats)
    return group_omp(list(a), list(b), list(e), ks, width, ridge)


CASES = [([1], 12), ([4], 10), ([1, 4], 10), ([9, 1], 7)]

# ---------------------------------------------------------------- greedy correctness


@pytest.mark.parametrize(("ks", "n"), CASES)
def test_each_step_is_brute_force_argmax(ks: list[int], n: int) -> None:
    rng = np.random.default_rng(sum(ks) * 100 + n)
    stats = [sample_stats(rng, n, k, o) for k, o in zip(ks, (5, 3))]
    path = run(stats, ks, n)
    for m in range(n):
        prefix = path.order[:m]
        base = total_direct(stats, ks, prefix, 1e-6)
        red = np.full(n, -np.inf)
        for c in set(range(n)) - set(prefix.tolist()):
            red[c] = base - total_direct(stats, ks, np.append(prefix, c), 1e-6)
        assert path.order[m] == np.argmax(red), f"step {m}"


@pytest.mark.parametrize(("ks", "n"), CASES)
@pytest.mark.parametrize("ridge", [1e-6, 1e-2])
def test_curve_matches_direct_formula(ks: list[int], n: int, ridge: float) -> None:
    rng = np.random.default_rng(7 + n)
    stats = [sample_stats(rng, n, k, o) for k, o in zip(ks, (4, 6))]
    width = n - 2
    path = run(stats, ks, width, ridge)
    assert path.order.shape == (width,) and path.curve.shape == (width + 1,)
    direct = [total_direct(stats, ks, path.order[:m], ridge) for m in range(width + 1)]
    np.testing.assert_allclose(path.curve, direct, rtol=1e-8)
    assert path.curve[0] == pytest.approx(sum(s[2] for s in stats))


@pytest.mark.parametrize("ks", [[1], [3], [1, 3]])
def test_recovers_exact_generating_channels(ks: list[int]) -> None:
    rng = np.random.default_rng(3)
    n, p, true = 16, 500, np.array([2, 9, 13])
    stats = []
    for k in ks:
        x = rng.standard_normal((p, n * k))
        cols = expand_channels(true, k)
        t = x[:, cols] @ rng.standard_normal((len(cols), 6)) + 1.5
        stats.append(explicit_stats(x, t))
    path = run(stats, ks, 8, ridge=1e-9)
    assert sorted(path.order[:3].tolist()) == true.tolist()
    np.testing.assert_array_equal(path.support(3), true)
    assert path.curve[3] < 1e-6 * path.curve[0]


@pytest.mark.parametrize(("ks", "n"), CASES)
def test_full_width_is_full_least_squares(ks: list[int], n: int) -> None:
    rng = np.random.default_rng(11 + n)
    p = 300
    samples, stats = [], []
    for k in ks:
        x = rng.standard_normal((p, n * k)) * rng.uniform(0.1, 3.0, n * k)
        t = x @ rng.standard_normal((n * k, 3)) + rng.standard_normal((p, 3))
        samples.append((x, t))
        stats.append(explicit_stats(x, t))
    path = run(stats, ks, n, ridge=0.0)
    assert np.all(np.diff(path.curve) <= 1e-12 * path.curve[0])
    np.testing.assert_array_equal(np.sort(path.order), np.arange(n))
    np.testing.assert_array_equal(path.support(n), np.arange(n))
    lstsq = 0.0
    for x, t in samples:
        design = np.hstack([x, np.ones((p, 1))])
        res = t - design @ np.linalg.lstsq(design, t, rcond=None)[0]
        lstsq += float(np.sum(res * res) / p)
    assert path.curve[n] == pytest.approx(lstsq, rel=1e-8)


@pytest.mark.parametrize(("ks", "n"), CASES)
def test_several_channels_a_step_keep_every_loss_exact(ks: list[int], n: int) -> None:
    """A step that adds channels together leaves the state of the set, whatever the grouping: its curve is the direct
    least-squares loss of each prefix at the steps' ends, and the gains after it are those of adding one at a time."""
    rng = np.random.default_rng(sum(ks) * 7 + n)
    stats = [sample_stats(rng, n, k, 5) for k in ks]
    a, b, e = (list(v) for v in zip(*stats))
    together, alone = GroupOmp(a, b, e, ks, n - 1, 1e-4), GroupOmp(a, b, e, ks, n - 1, 1e-4)
    chosen = rng.permutation(n)[:4]
    loss = together.add(chosen)
    for c in chosen:
        alone.add(int(c))
    assert loss == pytest.approx(total_direct(stats, ks, chosen, 1e-4), rel=1e-9)
    np.testing.assert_allclose(together.gains(), alone.gains(), rtol=1e-8, atol=1e-10 * e[0])
    path = _path(GroupOmp(a, b, e, ks, n - 1, 1e-4), n - 1, per_step=3)
    assert len(set(path.order)) == n - 1
    for width in range(3, n - 1, 3):
        assert path.curve[width] == pytest.approx(total_direct(stats, ks, path.order[:width], 1e-4), rel=1e-9)
    for width in (1, 2):  # inside a step: the loss after it
        assert path.curve[width] == path.curve[3]


def test_a_probe_path_takes_as_many_channels_a_step_as_keep_it_within_its_work() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((300, 8 * 9))
    t = x @ rng.standard_normal((72, 6)) + rng.standard_normal((300, 6))
    stats = ConsumerStats(72, 6)
    stats.update(x.astype(np.float32), t.astype(np.float32))
    assert path_work([9], [72], 6) == 81 * 72 * 36 / 2
    exact = stats_omp([stats], [9], 6)
    np.testing.assert_array_equal(stats_omp([stats], [9], 6, work=path_work([9], [72], 6)).order, exact.order)
    coarse = stats_omp([stats], [9], 6, work=path_work([9], [72], 6) / 3)  # 3 channels a step
    assert set(coarse.order[:3]) == set(np.argsort(-stats_omp_state([stats], [9], 6).gains())[:3])
    assert coarse.curve[1] == coarse.curve[3] and coarse.curve[4] == coarse.curve[6]
    assert exact.curve[1] > exact.curve[2] > exact.curve[3]


def test_the_omp_selector_takes_several_channels_a_step_only_past_its_work() -> None:
    from types import SimpleNamespace

    from onnxprune.strategies.selectors import OMP

    rng = np.random.default_rng(4)
    x = rng.standard_normal((300, 8 * 9))
    x[:, 54:63] = 2.0 * x[:, 9:18]  # channel 6 repeats channel 1: the exact greedy never keeps both
    t = x[:, 9:18] @ rng.standard_normal((9, 6)) * 3 + x @ rng.standard_normal((72, 6)) * 0.3
    stats = ConsumerStats(72, 6)
    stats.update(x.astype(np.float32), t.astype(np.float32))
    data = [SimpleNamespace(stats=stats, current=SimpleNamespace(k=9))]
    exact, _, _ = OMP().select(None, None, data, 4)
    np.testing.assert_array_equal(exact, stats_omp([stats], [9], 4).support(4))
    assert not {1, 6} <= set(exact)
    coarse, _, _ = OMP(work=path_work([9], [72], 4) / 2).select(None, None, data, 4)  # 2 a step: both at once
    assert {1, 6} <= set(coarse)


def test_a_state_that_owns_its_statistics_changes_them_in_place_to_the_same_path() -> None:
    # the centred statistics of a ConsumerStats are fresh arrays: copying them (D×D) cost ResNet-34 2 s
    rng = np.random.default_rng(8)
    a, b, e = sample_stats(rng, 8, 3, 4)
    want = GroupOmp([a], [b], [e], [3], 5)
    owned = GroupOmp([a.copy()], [b.copy()], [e], [3], 5, own=True)
    for _ in range(5):
        gains = want.gains()
        np.testing.assert_array_equal(owned.gains(), gains)
        c = int(np.argmax(gains))
        assert owned.add(c) == want.add(c)
    given = a.copy()
    held = GroupOmp([given], [b.copy()], [e], [3], 5, own=True)
    for c in want.chosen.nonzero()[0]:
        held.add(c)
    state = held.consumers[0]
    assert len(state.live) < 8 and state.g is given  # the chosen channels dropped, the Gram never copied


@pytest.mark.parametrize("k", [1, 3])
def test_collinear_channel_gives_no_reduction(k: int) -> None:
    rng = np.random.default_rng(5)
    n, p = 8, 200
    x = rng.standard_normal((p, n * k))
    x[:, 6 * k : 7 * k] = 2.0 * x[:, k : 2 * k]  # channel 6's block lies in channel 1's span
    t = x @ rng.standard_normal((n * k, 4)) + rng.standard_normal((p, 4))
    a, b, e = explicit_stats(x, t)
    path = group_omp([a], [b], [e], [k], n, ridge=0.0)
    assert np.all(np.isfinite(path.curve))
    assert path.order[-1] in (1, 6)
    assert path.curve[-1] == pytest.approx(path.curve[-2], rel=1e-9)
    np.testing.assert_array_equal(np.sort(path.order), np.arange(n))


# ---------------------------------------------------------------- centred statistics


def test_centred_matches_sample_covariances() -> None:
    rng = np.random.default_rng(2)
    p, d, o = 300, 6, 4
    x = rng.standard_normal((p, d)) + rng.uniform(-3, 3, d)
    t = rng.standard_normal((p, o)) + x[:, :o] + 5.0
    a, b, e = centred(x.T @ x, x.T @ t, x.sum(0), t.sum(0), float(np.sum(t * t)), p)
    cov = np.cov(np.hstack([x, t]).T, bias=True)
    np.testing.assert_allclose(a, cov[:d, :d], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(b, cov[:d, d:], rtol=1e-10, atol=1e-12)
    assert e == pytest.approx(np.trace(cov[d:, d:]), rel=1e-10)
    np.testing.assert_array_equal(a, a.T)


def test_few_positions_narrow_the_cross_to_their_count_and_keep_the_path() -> None:
    """A Gemm head on a few samples (P < O): the OMP runs on a (D, P) factor of B, with B's BBᵀ, and its path is the
    one of the full B (the curve to rounding, the order exactly while the reductions are far from ties)."""
    rng = np.random.default_rng(5)
    p, n, o = 12, 40, 60
    x = rng.standard_normal((p, n)) * rng.uniform(0.5, 2, n) + 1.0
    t = x @ rng.standard_normal((n, o)) + rng.standard_normal((p, o))
    a, b, e = explicit_stats(x, t)
    narrow = narrow_cross(x, t)
    assert narrow.shape == (n, p)
    np.testing.assert_allclose(narrow @ narrow.T, b @ b.T, rtol=1e-9, atol=1e-9 * np.abs(b @ b.T).max())
    stats = ConsumerStats(n, o)
    stats.update(x.astype(np.float32), t.astype(np.float32))
    assert stats_omp_state([stats], [1], 8).consumers[0].q.shape == (n, p)
    path = stats_omp([stats], [1], 8)
    full = group_omp([a], [b], [e], [1], 8, ridge=1e-4)
    np.testing.assert_array_equal(path.order, full.order)
    np.testing.assert_allclose(path.curve, full.curve, rtol=1e-4)


# ---------------------------------------------------------------- validation


def test_bad_inputs_raise() -> None:
    rng = np.random.default_rng(0)
    a, b, e = sample_stats(rng, 4, 2, 3)
    a1, b1, e1 = sample_stats(rng, 5, 1, 3)
    bad = [  # (A, B, e, ks, width, ridge)
        ([a], [b, b], [e], [2], 2, 1e-6),  # list lengths differ
        ([], [], [], [], 1, 1e-6),  # no consumer
        ([a[:, :-1]], [b], [e], [2], 2, 1e-6),  # A not square
        ([a], [b[:-1]], [e], [2], 2, 1e-6),  # B rows != D
        ([a], [b], [e], [3], 2, 1e-6),  # D not divisible by k
        ([a], [b], [e], [0], 2, 1e-6),  # k = 0
        ([a, a1], [b, b1], [e, e1], [2, 1], 2, 1e-6),  # channel counts differ (4 vs 5)
        ([a], [b], [e], [2], 0, 1e-6),  # width below 1
        ([a], [b], [e], [2], 5, 1e-6),  # width above N = 4
        ([a], [b], [e], [2], 2, -1.0),  # negative ridge
    ]
    for args in bad:
        with pytest.raises(ValueError):
            group_omp(*args)
    path = group_omp([a], [b], [e], [2], 2)
    with pytest.raises(ValueError):
        path.support(3)
    xx, xt = np.eye(3), np.ones((3, 2))
    for args in [
        (xx, xt, np.zeros(3), np.zeros(2), 1.0, 0),
        (xx[:2], xt, np.zeros(3), np.zeros(2), 1.0, 5),
        (xx, xt[:2], np.zeros(3), np.zeros(2), 1.0, 5),
        (xx, xt, np.zeros(2), np.zeros(2), 1.0, 5),
        (xx, xt, np.zeros(3), np.zeros(3), 1.0, 5),
    ]:
        with pytest.raises(ValueError):
            centred(*args)


def test_the_steps_factorise_on_one_torch_thread_and_leave_the_callers_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch's pool spinning between a step's tiny factorisations took the cores from the BLAS products (1.7× slower)
    import torch

    seen = []
    cholesky = torch.linalg.cholesky_ex

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return cholesky(*args, **kwargs)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", recording)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng = np.random.default_rng(3)
        run([sample_stats(rng, 6, 4, 3)], [4], 4)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
