"""Least-squares reconstruction of a pruned consumer from streamed statistics (float64)."""

from __future__ import annotations

import numpy as np

from onnxprune.imitation.stats import ConsumerStats


def expand_channels(keep: np.ndarray, k: int) -> np.ndarray:
    """Column indices of channels `keep`: i -> i*K, ..., i*K + K-1 (in the order of `keep`)."""
    keep = np.asarray(keep, dtype=np.int64)
    return (keep[:, None] * k + np.arange(k)).ravel()


def _ridge_solve(a: np.ndarray, b: np.ndarray, lam: float) -> np.ndarray:
    """X minimising tr(XᵀAX) - 2tr(XᵀB) + lam·||X||², i.e. (A + lam·I) X = B (lstsq if singular)."""
    m = a + lam * np.eye(len(a))
    try:
        return np.linalg.solve(m, b)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(m, b, rcond=None)[0]


def refit_full(
    stats: ConsumerStats, keep_cols: np.ndarray, ridge: float = 1e-4, prior: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(W' (O, |S|), b' (O,)) minimising Σ_p ||W' x_p[S] + b' - t_p||² + λ||W' - prior||²,
    λ = ridge·tr(xx_SS)/|S| (prior defaults to 0: plain ridge).

    Solved on centred statistics (the bias is not penalised): b' = mean t - W' mean x_S.
    """
    if stats.count == 0:
        raise ValueError("refit_full needs statistics over at least one position")
    s = np.asarray(keep_cols, dtype=np.int64)
    n = stats.count
    xx_s = stats.xx[np.ix_(s, s)]
    mx, mt = stats.sx[s] / n, stats.st / n
    cov = xx_s / n - np.outer(mx, mx)
    cross = stats.xt[s] / n - np.outer(mx, mt)
    lam = ridge * np.trace(xx_s) / (len(s) * n)  # per-position units, like cov
    if prior is not None:
        cross = cross + lam * np.asarray(prior, dtype=np.float64).T
    w = _ridge_solve(cov, cross, lam).T
    return w, mt - w @ mx


RIDGE_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)
CV_SOLVES = 2 * len(RIDGE_GRID) + 1  # least-squares solves of one ``refit_cv``: each ridge on each fold, then the best


def refit_cv(
    folds: tuple[ConsumerStats, ConsumerStats],
    keep_cols: np.ndarray,
    prior: np.ndarray,
    grid: tuple[float, ...] = RIDGE_GRID,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Refit with the ridge (towards ``prior``) chosen by two-fold cross-validation.

    Each fold's statistics fit, the other's score; the ridge with the lowest summed held-out
    loss is then used on both folds together. Returns (W', b', ridge). With few calibration
    samples per weight a plain least-squares refit over-fits; shrinking towards the original
    weights keeps it safe without a hand-tuned constant.
    """
    a, b = folds
    scores = []
    for ridge in grid:
        loss = 0.0
        for fit, held in ((a, b), (b, a)):
            w, bias = refit_full(fit, keep_cols, ridge, prior)
            loss += quadratic_loss_full(held, keep_cols, w, bias)
        scores.append(loss)
    best = grid[int(np.argmin(scores))]
    both = ConsumerStats(a.d, a.o)
    both.merge(a)
    both.merge(b)
    w, bias = refit_full(both, keep_cols, best, prior)
    return w, bias, best


def refit_scale(G_S: np.ndarray, c_S: np.ndarray, ridge: float = 1e-4) -> np.ndarray:
    """s minimising Σ_p ||Σ_{i∈S} s_i h_i(p) - (t_p - bias)||² + λ||s||² (= sᵀ(G_S + λI)s - 2sᵀc_S + const).

    λ = ridge·tr(G_S)/|S|; G_S, c_S are `neuron_gram`/`neuron_cross` restricted to the kept channels.
    """
    return _ridge_solve(G_S, np.asarray(c_S, dtype=np.float64), ridge * np.trace(G_S) / len(c_S))


def quadratic_loss_full(stats: ConsumerStats, keep_cols: np.ndarray, W: np.ndarray, b: np.ndarray) -> float:
    """Σ_p ||W x_p[S] + b - t_p||² = tr(W xx_SS Wᵀ) + 2bᵀW sx_S - 2tr(W xt_S) + n||b||² - 2bᵀst + tt."""
    s = np.asarray(keep_cols, dtype=np.int64)
    W = np.asarray(W, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    sx_s = stats.sx[s]
    return float(
        np.sum((W @ stats.xx[np.ix_(s, s)]) * W)
        + 2.0 * b @ (W @ sx_s)
        - 2.0 * np.sum(W * stats.xt[s].T)
        + stats.count * (b @ b)
        - 2.0 * b @ stats.st
        + stats.tt
    )


def centred_energy(stats: ConsumerStats) -> float:
    """Σ_p ||t_p - mean t||²: relative errors divide `quadratic_loss_full` by it (0 is exact, 1 is
    as good as predicting the mean output)."""
    return float(stats.tt - stats.st @ stats.st / max(stats.count, 1))
