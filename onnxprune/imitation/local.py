"""Greedy local imitation (Ye, Wu & Liu 2020, sec. 2.2 and appendix "Details on Solving ...").

Minimises the quadratic L(a) = aᵀGa - 2cᵀa + tau over the probability simplex by bi-directional
greedy steps a <- (1-γ)a + γ e_i that add, remove or re-weight one neuron at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from onnxprune.imitation.path import WidthPath

ZERO_REL = 1e-15
"""Weights at or below ZERO_REL · max(a) are set to exactly 0."""

G_REL = 1e-13
"""dᵀGd is floored at G_REL · max diag(G) before dividing by it (a flat direction has q ~ 0 too)."""

REFRESH_EVERY = 64
"""Steps between exact recomputations of G a (it is otherwise updated incrementally)."""


def loss(G: np.ndarray, c: np.ndarray, tau: float, a: np.ndarray) -> float:
    """L(a) = aᵀGa - 2cᵀa + tau."""
    return float(a @ G @ a - 2.0 * c @ a + tau)


def _directions(
    diag: np.ndarray, ga: np.ndarray, a: np.ndarray, c: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For every i with d = e_i - a: (q_i, g_i) = (-dᵀ(Ga - c), dᵀGd), so V_i(γ) = L(a) - 2γq_i + γ²g_i."""
    r = ga - c
    q = a @ r - r
    g = diag - 2.0 * ga + a @ ga
    return q, g


def _g_floor(diag: np.ndarray) -> float:
    """Floor for dᵀGd in divisions (see G_REL)."""
    return G_REL * max(float(diag.max()), np.finfo(float).tiny)


@dataclass(kw_only=True)
class LocalPath(WidthPath):
    """Trace of one greedy run.

    losses[k], supports[k]: loss and support size after k steps (k = 0 is the best single neuron).
    curve[n], best[n], weights/support/padded: see WidthPath.
    order: channels in the order they first entered the support.
    final: the weights a where the greedy stopped.
    Padding channels are the unselected ones with the largest unconstrained decrease q_i²/g_i (their
    direction correlates most with the residual, which a later least-squares refit can exploit).
    """

    losses: np.ndarray
    supports: np.ndarray
    order: np.ndarray
    final: np.ndarray
    G: np.ndarray = field(repr=False)
    c: np.ndarray = field(repr=False)

    def _pad_scores(self, m: int, a: np.ndarray) -> np.ndarray:
        diag = np.diag(self.G)
        q, g = _directions(diag, self.G @ a, a, self.c)
        return -(q * q / np.maximum(g, _g_floor(diag)))


def greedy_local(
    G: np.ndarray, c: np.ndarray, tau: float, *, max_steps: int | None = None, rel_tol: float = 1e-10
) -> LocalPath:
    """Greedy local imitation on L(a) = aᵀGa - 2cᵀa + tau over the simplex (G symmetric PSD, N x N).

    Starts at the best single neuron; each step takes the (i, γ), γ in U_i, with the lowest
    V_i(γ) = L((1-γ)a + γe_i), where U_i = [0, 1] for an unselected neuron and
    [-a_i/(1-a_i), 1] for a selected one (the lower end removes it exactly). Stops after
    `max_steps` (default 4N) steps, or once the loss or the best decrease falls below
    rel_tol · L(a_0). A step costs O(N): G a is updated incrementally.
    """
    G = np.ascontiguousarray(G, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    n = len(c)
    max_steps = 4 * n if max_steps is None else max_steps
    diag = np.diag(G).copy()
    g_floor = _g_floor(diag)

    i0 = int(np.argmin(diag - 2.0 * c))
    a = np.zeros(n)
    a[i0] = 1.0
    ga = G[i0].copy()
    cur = float(diag[i0] - 2.0 * c[i0] + tau)
    stop = rel_tol * (max(cur, 0.0) + np.finfo(float).tiny)
    losses, supports, order = [cur], [1], [i0]
    entered = np.zeros(n, dtype=bool)
    entered[i0] = True
    curve = np.full(n + 1, np.inf)
    curve[1] = cur
    best = {1: a.copy()}

    lo, gam, dec = np.empty(n), np.empty(n), np.empty(n)
    for step in range(1, max_steps + 1):
        if cur <= stop:
            break
        q, g = _directions(diag, ga, a, c)
        np.subtract(a, 1.0, out=lo)  # lo = -a/(1-a); -a/tiny for a_i = 1 (then d = 0, q = g = 0)
        np.minimum(lo, -np.finfo(float).tiny, out=lo)
        np.divide(a, lo, out=lo)
        np.maximum(g, g_floor, out=gam)  # flat directions: |q| <= sqrt(g L) is ~0 too
        np.divide(q, gam, out=gam)
        np.maximum(gam, lo, out=gam)
        np.minimum(gam, 1.0, out=gam)
        np.multiply(gam, g, out=dec)  # dec = L(a) - V_i(γ) = γ(2q - γg)
        np.subtract(2.0 * q, dec, out=dec)
        dec *= gam
        i = int(np.argmax(dec))
        if dec[i] < stop:
            break
        gi = float(gam[i])
        removing = a[i] > 0.0 and gi == lo[i]
        a *= 1.0 - gi
        a[i] += gi
        ga *= 1.0 - gi
        ga += gi * G[i]
        if removing:
            a[i] = 0.0
        a[a <= ZERO_REL * a.max()] = 0.0
        total = a.sum()
        a /= total
        # einsum, not G @ a: a threaded BLAS gemv in this loop stalls it on a busy machine
        ga = np.einsum("j,ji->i", a, G) if step % REFRESH_EVERY == 0 else ga / total
        cur = float(a @ ga - 2.0 * c @ a + tau)
        support = int(np.count_nonzero(a))
        if not entered[i] and a[i] > 0.0:
            entered[i] = True
            order.append(i)
        losses.append(cur)
        supports.append(support)
        if cur < curve[support]:
            curve[support] = cur
            best[support] = a.copy()

    return LocalPath(  # squared errors: a rounding below 0 is 0
        losses=np.maximum(losses, 0.0),
        supports=np.array(supports),
        curve=np.maximum(curve, 0.0),
        order=np.array(order),
        final=a,
        G=G,
        c=c,
        best=best,
    )
