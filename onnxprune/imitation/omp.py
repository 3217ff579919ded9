"""Group orthogonal matching pursuit over channels: greedy forward selection by exact LS reduction.

A group of N channels feeds consumers j = 1..J. Consumer j reads D_j = N·k_j columns (channel i owns
columns i·k_j … i·k_j + k_j - 1) and, for a kept channel set S with columns C = cols_j(S), has the
ridge least-squares loss (centred statistics, λ_j = ridge·tr(A_j)/D_j)

    loss_j(S) = e_j - tr(B_j[C]ᵀ (A_j[C,C] + λ_j I)^{-1} B_j[C]).

`group_omp` starts from S = ∅ and repeatedly adds the channel whose addition reduces Σ_j loss_j the
most. Per consumer it keeps an (A+λI)-orthonormal basis Z of the selected columns, the Schur
complement M_c = (A+λI)[c,c] - Z[:,c]ᵀZ[:,c] of every candidate block and the residual cross
Q_c = B[c] - Z[:,c]ᵀ L^{-1}B[C]; adding a block downdates both by rank k, so a step costs
O(|C|·k·D + D·O·k + N·k³) per consumer and the reduction of candidate c is tr(Q_cᵀ M_c^{-1} Q_c).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from onnxprune.imitation.refit import expand_channels
from onnxprune.imitation.gram import ConsumerStats, subtract_outer, symmetrize
from onnxprune.imitation.threads import one_torch_thread

REL_TOL = 1e-10
"""Schur-complement eigenvalues below REL_TOL × (largest diagonal of the candidate's block of A+λI)
count as 0: such directions already lie in the span of the selected columns and reduce nothing."""


@dataclass
class ChannelOrder:
    """Channels in the order a forward greedy chose them."""

    order: np.ndarray

    def support(self, width: int) -> np.ndarray:
        """The first `width` channels of `order`, sorted."""
        if not 0 <= width <= len(self.order):
            raise ValueError(f"width {width} outside 0..{len(self.order)}")
        return np.sort(self.order[:width])


@dataclass
class OmpPath(ChannelOrder):
    """Greedy path: `order` (width,) channels in the order chosen; `curve` (width + 1,) with
    curve[m] = Σ_j loss_j(first m channels of order), curve[0] = Σ_j e_j."""

    curve: np.ndarray


def centred(
    xx: np.ndarray, xt: np.ndarray, sx: np.ndarray, st: np.ndarray, tt: float, count: int
) -> tuple[np.ndarray, np.ndarray, float]:
    """Per-position centred (A, B, e) from streamed sums Σ x xᵀ (D, D), Σ x tᵀ (D, O), Σ x (D,),
    Σ t (O,), Σ ||t||² over `count` positions: A = xx/n - m_x m_xᵀ, B = xt/n - m_x m_tᵀ,
    e = tt/n - ||m_t||²."""
    xx, xt = np.asarray(xx, dtype=np.float64), np.asarray(xt, dtype=np.float64)
    sx, st = np.asarray(sx, dtype=np.float64), np.asarray(st, dtype=np.float64)
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    if xx.ndim != 2 or xx.shape[0] != xx.shape[1]:
        raise ValueError(f"xx must be square, got shape {xx.shape}")
    d = xx.shape[0]
    if xt.ndim != 2 or xt.shape[0] != d:
        raise ValueError(f"xt must have shape ({d}, O), got {xt.shape}")
    if sx.shape != (d,) or st.shape != (xt.shape[1],):
        raise ValueError(
            f"sx/st must have shapes ({d},)/({xt.shape[1]},), got {sx.shape}/{st.shape}"
        )
    mx, mt = sx / count, st / count
    a = symmetrize(subtract_outer(xx / count, mx, mx))
    return a, subtract_outer(xt / count, mx, mt), max(float(tt / count - mt @ mt), 0.0)


class _Consumer:
    """Incremental state of one consumer over its live channels (those not chosen, plus chosen ones not dropped
    yet): basis rows z (rows, D_live), Schur blocks m (N_live, k, k), residual cross q (D_live, O) (rows p·k …
    p·k + k - 1 are Q of the channel at live position p), the ridge Gram g (D, D) over every column, read at the
    live channels' columns."""

    def __init__(self, a: np.ndarray, b: np.ndarray, k: int, ridge: float, width: int, own: bool = False) -> None:
        d = len(a)
        self.k, self.n, self.width = k, d // k, width
        self.g = a if own else a.copy()
        self.g[np.diag_indices(d)] += ridge * np.trace(a) / d
        blocks = np.diagonal(self.g.reshape(self.n, k, self.n, k), axis1=0, axis2=2)
        self.m = np.ascontiguousarray(blocks.transpose(2, 0, 1))
        diag = np.diagonal(self.m, axis1=1, axis2=2)
        self.floor = REL_TOL * diag.max(axis=1) + np.finfo(np.float64).tiny
        self.q = b if own else b.copy()
        self.z = np.empty((width * k, d))
        self.rows = 0
        self.live = np.arange(self.n)
        self.dead = np.zeros(self.n, dtype=bool)  # chosen, still in the live arrays

    def gains(self, skip: np.ndarray) -> np.ndarray:
        """(N,) reduction of this consumer's loss by adding each channel (0 where degenerate or ``skip``)."""
        out = np.zeros(self.n)
        out[self.live] = self._gains(skip[self.live])
        return out

    def _gains(self, skip: np.ndarray) -> np.ndarray:
        if self.k == 1:
            m = self.m[:, 0, 0]
            ok = m > self.floor
            return np.where(ok, np.einsum("ij,ij->i", self.q, self.q) / np.where(ok, m, 1.0), 0.0)
        q = self.q.reshape(len(self.live), self.k, -1)
        s = q @ q.transpose(0, 2, 1)  # Q_c Q_cᵀ: the O-wide products happen once, not per direction
        # tr(M_c⁻¹ S_c) = tr(L⁻¹ S L⁻ᵀ) by Cholesky where every eigenvalue of M_c is surely above the floor
        # (λ_min ≥ 1/‖L⁻¹‖_F²); the eigendecomposition, which drops directions under it, serves the rest.
        with one_torch_thread():
            lower, info = torch.linalg.cholesky_ex(torch.from_numpy(self.m))
            inv = torch.linalg.solve_triangular(lower, torch.eye(self.k, dtype=lower.dtype).expand_as(lower),
                                                upper=False).numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            bound = 1.0 / np.sum(inv * inv, axis=(1, 2))
        fast = (info.numpy() == 0) & (bound > self.floor) & ~skip
        out = np.zeros(len(self.live))
        out[fast] = np.sum((inv[fast] @ s[fast]) * inv[fast], axis=(1, 2))
        slow = ~fast & ~skip
        if slow.any():
            w, v = np.linalg.eigh(self.m[slow])
            keep = np.where(w > self.floor[slow, None], 1.0 / np.where(w > 0, w, 1.0), 0.0)
            out[slow] = np.einsum("nk,nkk->n", keep, v.transpose(0, 2, 1) @ s[slow] @ v)
        return out

    def add(self, cs: np.ndarray) -> float:
        """Select channels ``cs`` together: extend z, downdate m and q; return the exact loss reduction."""
        ps = np.searchsorted(self.live, cs)
        cols = expand_channels(ps, self.k)
        z = self.z[: self.rows]
        # (A+λI)[cols] less its span so far; np.take gathers columns several times faster than fancy indexing
        rows = np.take(self.g[expand_channels(cs, self.k)], expand_channels(self.live, self.k), axis=1)
        proj = rows - np.ascontiguousarray(np.take(z, cols, axis=1).T) @ z
        joint = proj[:, cols]  # the block's Schur complement: kept for one channel, its cross terms for several
        w, v = np.linalg.eigh(self.m[ps[0]] if len(ps) == 1 else (joint + joint.T) / 2)
        keep = w > self.floor[ps].max()
        basis = v[:, keep] / np.sqrt(w[keep])
        z_new = basis.T @ proj
        p_new = basis.T @ self.q[cols]
        self.z[self.rows : self.rows + len(z_new)] = z_new
        self.rows += len(z_new)
        zb = z_new.reshape(len(z_new), len(self.live), self.k).transpose(1, 2, 0)
        self.m -= zb @ zb.transpose(0, 2, 1)
        self.q -= np.einsum("ad,ao->do", z_new, p_new) if self.k == 1 else z_new.T @ p_new  # gemm is slow for k = 1
        self.dead[ps] = True
        if self.dead.sum() * 4 >= len(self.live):
            self._drop_chosen()
        return float(np.sum(p_new * p_new))

    def _drop_chosen(self) -> None:
        """Drop the chosen channels' columns from the state: nothing reads them again, and each step's products ran
        over them (for a path to 3/4 of the channels, about half the work of its steps). The Gram is not copied:
        a step reads k of its rows."""
        alive = ~self.dead
        cols = expand_channels(np.flatnonzero(alive), self.k)
        z = np.empty((self.width * self.k, len(cols)))
        np.take(self.z[: self.rows], cols, axis=1, out=z[: self.rows])
        self.z, self.q = z, self.q[cols]
        self.m, self.floor, self.live = self.m[alive], self.floor[alive], self.live[alive]
        self.dead = np.zeros(len(self.live), dtype=bool)


def _validate(
    a: list[np.ndarray], b: list[np.ndarray], e: list[float], ks: list[int], width: int, ridge: float
) -> int:
    """Check shapes and arguments of `group_omp`; return the channel count N."""
    if not a or not len(a) == len(b) == len(e) == len(ks):
        raise ValueError(
            f"A, B, e, ks must be non-empty and of equal length, got "
            f"{len(a)}, {len(b)}, {len(e)}, {len(ks)}"
        )
    if not (np.isfinite(ridge) and ridge >= 0):
        raise ValueError(f"ridge must be finite and >= 0, got {ridge}")
    channels = set()
    for j, (aj, bj, kj) in enumerate(zip(a, b, ks)):
        if aj.ndim != 2 or aj.shape[0] != aj.shape[1]:
            raise ValueError(f"A[{j}] must be square, got shape {aj.shape}")
        if bj.ndim != 2 or bj.shape[0] != aj.shape[0]:
            raise ValueError(f"B[{j}] must have shape ({aj.shape[0]}, O), got {bj.shape}")
        if kj < 1 or aj.shape[0] % kj:
            raise ValueError(f"D[{j}] = {aj.shape[0]} is not a positive multiple of k = {kj}")
        channels.add(aj.shape[0] // kj)
    if len(channels) != 1:
        raise ValueError(f"consumers disagree on the channel count: {sorted(channels)}")
    n = channels.pop()
    if not 1 <= width <= n:
        raise ValueError(f"width {width} outside 1..{n}")
    return n


class GroupOmp:
    """Incremental group OMP over the consumers' centred statistics (see ``group_omp``): ``gains()`` of every
    channel not chosen yet (-inf for the chosen), ``add(c)`` to choose one (at most ``width``)."""

    def __init__(self, A: list[np.ndarray], B: list[np.ndarray], e: list[float], ks: list[int], width: int,
                 ridge: float = 1e-6, own: bool = False) -> None:
        """``own``: A and B are the state's to change in place (fresh centred statistics), not copied (D×D each)."""
        a = [np.asarray(aj, dtype=np.float64) for aj in A]
        b = [np.asarray(bj, dtype=np.float64) for bj in B]
        self.n = _validate(a, b, e, ks, width, ridge)
        self.consumers = [_Consumer(aj, bj, int(kj), ridge, width, own) for aj, bj, kj in zip(a, b, ks)]
        self.chosen = np.zeros(self.n, dtype=bool)
        self.loss = float(np.sum(e))

    def gains(self) -> np.ndarray:
        total = sum(cons.gains(self.chosen) for cons in self.consumers)
        total[self.chosen] = -np.inf
        return total

    def add(self, c: int | np.ndarray) -> float:
        """Choose channel ``c`` (or several at once); the summed loss after it."""
        cs = np.unique(np.atleast_1d(np.asarray(c, dtype=np.int64)))
        if self.chosen[cs].any():
            raise ValueError(f"channel {cs[self.chosen[cs]][0]} is chosen already")
        self.chosen[cs] = True
        self.loss -= sum(cons.add(cs) for cons in self.consumers)
        return self.loss


def group_omp(
    A: list[np.ndarray],
    B: list[np.ndarray],
    e: list[float],
    ks: list[int],
    width: int,
    ridge: float = 1e-6,
) -> OmpPath:
    """Greedily choose `width` of the N channels, each step adding the channel that reduces
    Σ_j loss_j the most (see the module docstring); A[j] (D_j, D_j), B[j] (D_j, O_j) and e[j] are
    consumer j's centred statistics (`centred`), ks[j] its columns per channel."""
    return _path(GroupOmp(A, B, e, ks, width, ridge), width)


def _path(state: GroupOmp, width: int, per_step: int = 1) -> OmpPath:
    """The greedy path to ``width``, each step adding the ``per_step`` channels of the largest gains (1: the exact
    greedy; the curve holds the loss after each step at all of its widths)."""
    order = np.empty(width, dtype=np.int64)
    curve = np.empty(width + 1)
    curve[0] = state.loss
    for step in range(0, width, per_step):
        take = min(per_step, width - step)
        gains = state.gains()
        order[step : step + take] = [int(np.argmax(gains))] if take == 1 else np.argsort(-gains, kind="stable")[:take]
        curve[step + 1 : step + take + 1] = state.add(order[step : step + take])
    return OmpPath(order, np.maximum(curve, 0.0))  # squared errors: a rounding below 0 is 0


PROBE_WORK = 1e10
"""Multiply-adds of an exact path's basis products (``path_work``) past which a sensitivity probe's path takes
several channels a step: ResNet-34's 512-channel 3×3 groups (2.8e10) take 3, every group of MobileNetV2 (at most
5.9e8) and YOLOv8n (6.9e9) stays exact."""

SELECT_WORK = 1e10
"""The same bound for the OMP selector's path to the allocated width: ResNet-34's 512-channel groups at 0.85× take 2–3
a step (the widest one's path 2.8 → 1.4 s, its relative error unchanged at 6e-5); on YOLOv8n's largest group (3.1e9), 4
a step would raise it 0.01500 → 0.01511, 7 a step cost mAP50-95 0.675 → 0.663 at 0.70× (the notebook's "Probes and
selection past a work bound")."""


def path_work(ks: list[int], ds: list[int], width: int) -> float:
    """Multiply-adds of the basis products of an exact path to ``width``: step s reads s·k rows of every
    consumer's D-wide basis, k of them at a time (Σ_j k_j²·D_j·width²/2)."""
    return sum(k * k * d for k, d in zip(ks, ds)) * width * width / 2


RIDGE = 1e-4  # of the group OMP's least squares, relative to the trace (as the refit's smallest)


def stats_omp(stats: list[ConsumerStats], ks: list[int], width: int, ridge: float = RIDGE,
              work: float = np.inf) -> OmpPath:
    """``group_omp`` of consumers given by their streamed statistics (``ks``: columns per channel of each), taking
    as many channels a step as keep the basis products within ``work`` multiply-adds (``path_work``; inf: exact)."""
    per_step = max(1, math.ceil(path_work(ks, [s.d for s in stats], width) / work))
    return _path(stats_omp_state(stats, ks, width, ridge), width, per_step)


def stats_omp_state(stats: list[ConsumerStats], ks: list[int], width: int, ridge: float = RIDGE) -> GroupOmp:
    """The incremental ``GroupOmp`` of consumers given by their streamed statistics."""
    a, b, e = zip(*(centred(s.xx, s.xt, s.sx, s.st, s.tt, s.count) for s in stats))
    b = [bj if s.rows is None or s.count >= bj.shape[1] else narrow_cross(*s.rows) for s, bj in zip(stats, b)]
    return GroupOmp(list(a), list(b), list(e), ks, width, ridge=ridge, own=True)  # ``centred`` made them


def narrow_cross(x: np.ndarray, t: np.ndarray) -> np.ndarray:
    """A (D, P) factor B' of the centred cross B = X_cᵀT_c/P of positions x (P, D), t (P, O): B'B'ᵀ = BBᵀ.

    The OMP reads B only through BBᵀ (every reduction is a trace of Q_cᵀ M_c⁻¹ Q_c), and each step downdates Q over
    all of B's columns: with fewer positions than outputs (a Gemm head calibrated on 32 samples, O = 4096) the
    factor does the same work on P columns instead of O."""
    xc, tc = x - x.mean(axis=0), t - t.mean(axis=0)
    w, v = np.linalg.eigh(tc @ tc.T)
    return xc.T @ (v * np.sqrt(np.clip(w, 0.0, None))) / len(x)
