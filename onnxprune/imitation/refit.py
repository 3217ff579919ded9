"""Least-squares reconstruction of a pruned consumer from streamed statistics (float64)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from onnxprune.imitation.gram import ConsumerStats, subtract_outer


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


Fit = Callable[[float], tuple[np.ndarray, np.ndarray]]  # ridge -> (W' (O, |S|), b' (O,))


def refit_full(
    stats: ConsumerStats, keep_cols: np.ndarray, ridge: float = 1e-4, prior: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(W' (O, |S|), b' (O,)) minimising Σ_p ||W' x_p[S] + b' - t_p||² + λ||W' - prior||²,
    λ = ridge·tr(xx_SS)/|S| (prior defaults to 0: plain ridge).

    Solved on centred statistics (the bias is not penalised): b' = mean t - W' mean x_S.
    """
    return _fitter(stats, np.asarray(keep_cols, dtype=np.int64), prior)(ridge)


def _fitter(stats: ConsumerStats, s: np.ndarray, prior: np.ndarray | None) -> Fit:
    """``refit_full`` of ``stats`` on columns ``s`` for any ridge, the work shared between ridges done once: with
    fewer positions P than columns (their rows kept) in the positions' space (an eigendecomposition of the P×P
    kernel serves every ridge), else by solving the |S|×|S| normal equations."""
    if stats.count == 0:
        raise ValueError("refit_full needs statistics over at least one position")
    n = stats.count
    rows = _rows_for(stats, s)
    if rows is not None:
        return _Dual(rows[0][:, s], rows[1], stats.xx.diagonal()[s].sum() / (len(s) * n), prior)
    xx_s = stats.xx[np.ix_(s, s)]  # a copy: divided in place below
    trace = np.trace(xx_s)
    mx, mt = stats.sx[s] / n, stats.st / n
    cov = subtract_outer(np.divide(xx_s, n, out=xx_s), mx, mx)
    cross = subtract_outer(stats.xt[s] / n, mx, mt)

    def fit(ridge: float) -> tuple[np.ndarray, np.ndarray]:
        lam = ridge * trace / (len(s) * n)  # per-position units, like cov
        w = _ridge_solve(cov, cross if prior is None else cross + lam * np.asarray(prior, dtype=np.float64).T, lam).T
        return w, mt - w @ mx

    return fit


def _rows_for(stats: ConsumerStats, s: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The positions kept in ``stats`` where they are fewer than the columns ``s`` (the fit is cheaper from them)."""
    return stats.rows if stats.count < len(s) else None


class _Dual:
    """The ridge fit of t (P, O) on x (P, S) with λ = ridge·``scale``, from the positions: with X, T centred and
    Δ = W'ᵀ - priorᵀ, (XᵀX + Pλ I) Δ = Xᵀ(T - X priorᵀ) gives Δ = Xᵀ (XXᵀ + Pλ I)⁻¹ (T - X priorᵀ). Called with a
    ridge it is a ``Fit`` (one P×P solve); ``held_losses`` scores a grid of ridges through one eigendecomposition of
    the kernel XXᵀ."""

    def __init__(self, x: np.ndarray, t: np.ndarray, scale: float, prior: np.ndarray | None) -> None:
        self.mx, self.mt, self.scale, self.count = x.mean(axis=0), t.mean(axis=0), scale, len(x)
        self.xc = x - self.mx
        self.base = np.zeros((x.shape[1], t.shape[1])) if prior is None else np.asarray(prior, dtype=np.float64).T
        self.kernel = self.xc @ self.xc.T
        self.residual = t - self.mt - self.xc @ self.base

    def _inverse(self, evals: np.ndarray, ridge: float) -> np.ndarray:
        denom = np.maximum(evals, 0.0) + self.count * ridge * self.scale
        return np.divide(1.0, denom, out=np.zeros_like(denom), where=denom > 0)  # 0: the directions X never spans

    def __call__(self, ridge: float) -> tuple[np.ndarray, np.ndarray]:
        alpha = _ridge_solve(self.kernel, self.residual, self.count * ridge * self.scale)
        w = (self.base + self.xc.T @ alpha).T
        return w, self.mt - w @ self.mx

    def held_losses(self, x: np.ndarray, t: np.ndarray, grid: tuple[float, ...]) -> np.ndarray:
        """Σ_p ||W' x_p + b' - t_p||² over held-out positions x (H, S), t (H, O) for each ridge of ``grid``, without
        forming W': the prediction is (x - m_x) priorᵀ + m_t + K U diag(1/(e + Pλ)) Uᵀ(...) with K the (H, P) kernel
        of the held-out positions against the fit's, so a ridge costs H·P·O instead of 2·S·P·O + H·S·O."""
        evals, u = np.linalg.eigh(self.kernel)
        ur = u.T @ self.residual
        xh = x - self.mx
        ku = (xh @ self.xc.T) @ u
        start = xh @ self.base + self.mt - t
        return np.array([float(np.sum(np.square(start + ku @ (ur * self._inverse(evals, r)[:, None]))))
                         for r in grid])

    def kernel_cheaper(self, held: int, grid: int) -> bool:
        """Whether ``held_losses`` on ``held`` positions costs fewer multiplications than ``grid`` fits and scores
        (an eigendecomposition of the kernel counted as 2·P³, measured about three P×P solves)."""
        (p, s), o = self.xc.shape, self.residual.shape[1]
        return 2 * p**3 + held * (s * o + s * p + p * p + grid * p * o) < grid * (
            p**3 / 3 + p * p * o + s * p * o + held * s * o)


def _scorer(stats: ConsumerStats, s: np.ndarray) -> Callable[[np.ndarray, np.ndarray], float]:
    """``quadratic_loss_full`` on columns ``s``, from the positions where fewer than |S| are kept."""
    rows = _rows_for(stats, s)
    if rows is None:
        return _restricted_loss(stats, s)
    x, t = rows[0][:, s], rows[1]
    return lambda w, b: float(np.sum(np.square(x @ w.T + b - t)))


RIDGE_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def _descend(score: Callable[[int], float], n: int) -> int:
    """The first index of the least ``score`` over 0 … n-1 where the scores fall to one minimum and rise after it:
    from the middle pair, walking downhill (3–4 of 6 scores asked; a score with several minima gives one of them)."""
    i = max(0, n // 2 - 1)
    step = -1 if i + 1 >= n or score(i) <= score(i + 1) else 1
    while 0 <= i + step < n and (score(i + step) <= score(i) if step < 0 else score(i + step) < score(i)):
        i += step
    return i


DESCENT_SCORES = max(len(RIDGE_GRID) // 2 + 1, len(RIDGE_GRID) - len(RIDGE_GRID) // 2 + 1)  # the most _descend asks
CV_SOLVES = 2 * DESCENT_SCORES + 1  # least-squares solves of one ``refit_cv`` at most: the ridges scored on each fold,
# then the best


def _held_out(fit: ConsumerStats, held: ConsumerStats, s: np.ndarray, prior: np.ndarray,
              grid: tuple[float, ...]) -> Callable[[int], float]:
    """The loss on ``held`` of the refit on ``fit`` at ridge ``grid[i]``, fitted when first asked (every ridge at once
    through the positions' kernel, where that costs less)."""
    solve, rows = _fitter(fit, s, prior), _rows_for(held, s)
    if isinstance(solve, _Dual) and rows is not None and solve.kernel_cheaper(len(rows[0]), len(grid)):
        losses = solve.held_losses(rows[0][:, s], rows[1], grid)
        return lambda i: float(losses[i])
    loss = _scorer(held, s)
    return functools.cache(lambda i: loss(*solve(grid[i])))


def refit_cv(
    folds: tuple[ConsumerStats, ConsumerStats],
    keep_cols: np.ndarray,
    prior: np.ndarray,
    grid: tuple[float, ...] = RIDGE_GRID,
    merged: ConsumerStats | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Refit with the ridge (towards ``prior``) chosen by two-fold cross-validation.

    Each fold's statistics fit, the other's score; the ridge with the lowest summed held-out loss, found by
    descending the grid from its middle (``_descend``: on 151 refits of MobileNetV2, YOLOv8n and ResNet-34 the loss
    over the grid had one minimum every time), is then used on both folds together (``merged``, where the caller
    holds their merge). Returns (W', b', ridge). With few calibration samples per weight a plain least-squares
    refit over-fits; shrinking towards the original weights keeps it safe without a hand-tuned constant.
    """
    a, b = folds
    s = np.asarray(keep_cols, dtype=np.int64)
    judges = [_held_out(fit, held, s, prior, grid) for fit, held in ((a, b), (b, a))]
    best = grid[_descend(lambda i: sum(judge(i) for judge in judges), len(grid))]
    del judges  # their fits' S×S arrays, before the merged fit's
    if merged is None:
        merged = ConsumerStats(a.d, a.o)
        merged.merge(a)
        merged.merge(b)
    w, bias = _fitter(merged, s, prior)(best)
    return w, bias, best


def refit_scale(G_S: np.ndarray, c_S: np.ndarray, ridge: float = 1e-4) -> np.ndarray:
    """s minimising Σ_p ||Σ_{i∈S} s_i h_i(p) - (t_p - bias)||² + λ||s||² (= sᵀ(G_S + λI)s - 2sᵀc_S + const).

    λ = ridge·tr(G_S)/|S|; G_S, c_S are `neuron_gram`/`neuron_cross` restricted to the kept channels.
    """
    return _ridge_solve(G_S, np.asarray(c_S, dtype=np.float64), ridge * np.trace(G_S) / len(c_S))


def quadratic_loss_full(stats: ConsumerStats, keep_cols: np.ndarray, W: np.ndarray, b: np.ndarray) -> float:
    """Σ_p ||W x_p[S] + b - t_p||² = tr(W xx_SS Wᵀ) + 2bᵀW sx_S - 2tr(W xt_S) + n||b||² - 2bᵀst + tt."""
    return _restricted_loss(stats, np.asarray(keep_cols, dtype=np.int64))(W, b)


def _restricted_loss(stats: ConsumerStats, s: np.ndarray) -> Callable[[np.ndarray, np.ndarray], float]:
    """``quadratic_loss_full`` on columns ``s`` for any (W, b), the statistics restricted to them once (a
    cross-validation scores every ridge on the same columns)."""
    xx_s, sx_s, xt_s = stats.xx[np.ix_(s, s)], stats.sx[s], stats.xt[s].T

    def loss(W: np.ndarray, b: np.ndarray) -> float:
        W = np.asarray(W, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        return float(
            np.sum((W @ xx_s) * W)
            + 2.0 * b @ (W @ sx_s)
            - 2.0 * np.sum(W * xt_s)
            + stats.count * (b @ b)
            - 2.0 * b @ stats.st
            + stats.tt
        )

    return loss


def centred_energy(stats: ConsumerStats) -> float:
    """Σ_p ||t_p - mean t||²: relative errors divide `quadratic_loss_full` by it (0 is exact, 1 is
    as good as predicting the mean output)."""
    return float(stats.tt - stats.st @ stats.st / max(stats.count, 1))
