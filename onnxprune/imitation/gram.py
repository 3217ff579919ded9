"""Streamed second-order statistics of a consumer layer and the neuron quadratics built from them.

A consumer (Conv/Gemm) reads N channels; unfolded, its input at position p is x_p in R^D with
D = N*K (column i*K + k belongs to channel i) and its output is t_p = W x_p + b, W of shape (O, D).
Channel i contributes h_i(p) = W[:, iK:(i+1)K] @ x_p[iK:(i+1)K] to t_p - b.
"""

from __future__ import annotations

import math

import numpy as np
import torch

CHUNK_ROWS = 65536
"""Positions per float32 product: bounds the float32 rounding error before float64 accumulation."""

_BLOCK_ELEMENTS = 1 << 22
"""Elements of one row block of W^T W in `neuron_gram` (keeps temporaries at ~32 MiB)."""


def subtract_outer(a: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``a -= u vᵀ`` in place, a block of rows at a time: the same values as ``a - np.outer(u, v)`` without the
    D×D temporary, whose fresh pages cost more than the arithmetic (D = 4608: 0.4–0.8 s against 0.03 s)."""
    rows = max(1, _BLOCK_ELEMENTS // 16 // max(len(v), 1))
    for r in range(0, len(u), rows):
        a[r : r + rows] -= np.outer(u[r : r + rows], v)
    return a


def symmetrize(a: np.ndarray, block: int = 256) -> np.ndarray:
    """``a`` made symmetric in place, square blocks at a time: the same values as ``(a + a.T) / 2`` (addition
    commutes exactly) without reading a D×D matrix transposed in one sweep (D = 4608: 0.13–0.5 s against 0.05 s)."""
    for i in range(0, len(a), block):
        for j in range(i, len(a), block):
            s = a[i : i + block, j : j + block] + a[j : j + block, i : i + block].T
            s /= 2
            a[i : i + block, j : j + block] = s
            a[j : j + block, i : i + block] = s.T
    return a


GRAM_ROWS = 256
"""Rows of xx per product while accumulating: only blocks on and above the diagonal are multiplied (xx is symmetric),
about half the work where D is in the thousands (D = 4608: 0.25 -> 0.11 s a chunk of 784 positions)."""


def _mirrored(xx: torch.Tensor) -> None:
    """Fill xx's blocks below the diagonal (``GRAM_ROWS`` wide) from those above it, in place. A GEMM's zzᵀ is
    symmetric bit for bit, so these are the values the whole product would have given."""
    for r in range(0, len(xx), GRAM_ROWS):
        for c in range(r + GRAM_ROWS, len(xx), GRAM_ROWS):  # square blocks: a transposed copy that stays in cache
            xx[c : c + GRAM_ROWS, r : r + GRAM_ROWS] = xx[r : r + GRAM_ROWS, c : c + GRAM_ROWS].T


def _as_float32_tensor(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """A float32 torch view/copy of a numpy array or tensor (device kept)."""
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(np.ascontiguousarray(a))
    return a.detach().to(torch.float32)


SHIFT_RATIO = 4.0
"""A column is shifted by its mean over the first chunk where that mean is over SHIFT_RATIO standard deviations: there,
float32 products of the raw values would lose over log2(SHIFT_RATIO²) = 4 bits of its variance. Elsewhere the shift
is 0 (the sums are those of the raw values, exact for small dyadic data)."""


SHIFT_POSITIONS = 4096
"""Positions of the first chunk the shift is estimated on (evenly spaced): any shift near the mean will do, the
sums are reconstructed exactly from the one taken."""


def _shift(a: torch.Tensor) -> torch.Tensor:
    """The float32 shift of each column of ``a`` (B, columns, L) (see SHIFT_RATIO), estimated on at most about
    SHIFT_POSITIONS of its positions, evenly spaced."""
    b, _, length = a.shape
    rows = a[:: max(1, b * min(length, SHIFT_POSITIONS) // SHIFT_POSITIONS)]
    rows = rows[:, :, :: max(1, len(rows) * length // SHIFT_POSITIONS)]
    sample = rows.transpose(0, 1).reshape(rows.shape[1], rows.shape[0] * rows.shape[2]).double()
    mean = sample.mean(dim=1)
    spread = (sample - mean[:, None]).square().mean(dim=1).sqrt()
    return torch.where(mean.abs() > SHIFT_RATIO * spread, mean, torch.zeros_like(mean)).float()


class Scratch:
    """One float32 buffer that the chunks of a loop reuse: glibc returns every freed block over 32 MB to the kernel,
    which zeroes its pages again at the next allocation (a U²-Net-like compress spent as long in the kernel as in
    user code)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None
        self._device: torch.device | str | None = None  # as asked for ("cuda" is the buffer's "cuda:0")

    def take(self, shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
        """A float32 tensor of ``shape`` (uninitialised, contiguous) on ``device``, in the buffer when it fits."""
        n = math.prod(shape)
        if self._buffer is None or self._buffer.numel() < n or self._device != device:
            self._buffer = None  # the old one goes before the new one is allocated
            self._buffer, self._device = torch.empty(n, dtype=torch.float32, device=device), device
        return self._buffer[:n].view(shape)


Sums = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # xx, xt, sx, st, tt


def _moved(sums: Sums, n: int, dx: torch.Tensor, dt: torch.Tensor) -> Sums:
    """The sums of (x + dx, t + dt) over ``n`` positions, from those of (x, t) (float64); the same tensors where
    both moves are 0 (merging unshifted folds: D² outer products of zeros otherwise)."""
    if not (bool(dx.any()) or bool(dt.any())):
        return sums
    xx, xt, sx, st, tt = sums
    moved = torch.empty_like(xx)
    for r in range(0, len(xx), GRAM_ROWS):  # row blocks: no D×D temporaries (four of them cost 0.1 s at D = 4608)
        rows = slice(r, r + GRAM_ROWS)
        block = torch.add(xx[rows], torch.outer(dx[rows], sx), out=moved[rows])
        block += torch.outer(sx[rows], dx)
        block += n * torch.outer(dx[rows], dx)
    return (moved,
            xt + torch.outer(dx, st) + torch.outer(sx, dt) + n * torch.outer(dx, dt),
            sx + n * dx, st + n * dt, tt + 2 * dt @ st + n * dt @ dt)


class ConsumerStats:
    """Streaming float64 sums over positions p: xx = Σ x xᵀ, xt = Σ x tᵀ, sx = Σ x, st = Σ t, tt = Σ ||t||².

    `count` is the number of positions, or with weights (``update``'s) their sum: every sum then weighs position p
    by w_p, as if it were repeated w_p times (a weighted least squares).

    Products are taken in float32 on chunks of at most `CHUNK_ROWS` rows (on the inputs' device when
    given torch tensors) and accumulated in float64, of x and t less a shift (a column's mean over the first chunk,
    where that mean is large against its spread: an unfolded BatchNorm's input, raw pixels): such a column would
    otherwise lose its variance to float32 rounding, and the centred losses built from these sums could come out
    negative (``SHIFT_RATIO``). The properties give the raw sums back, in float64. On CUDA keep TF32 matmul disabled
    (`torch.backends.cuda.matmul.allow_tf32 = False`, the default), or xx/xt lose ~3 digits.
    The properties xx, xt, sx, st are float64 numpy arrays. While there are fewer positions than columns, the
    positions themselves are kept too (``rows``, at most half the bytes of xx): a least-squares fit then solves in
    their space, P³ instead of D³ (``imitation.refit``).
    """

    def __init__(self, d: int, o: int) -> None:
        self.d, self.o = d, o
        # of the shifted x and t; allocated by the first update, or taken from the first merge: a D×D float64 array is
        # fresh memory each time (D = 4608: 0.2 s of page faults), and a merge's sum another
        self._sums: Sums | None = None
        self._shift: tuple[torch.Tensor, torch.Tensor] | None = None  # float32 (D,), (O,): set by the first chunk
        self._shifted = (False, False)  # whether each shift has a non-zero entry
        self._cache: Sums | None = None  # the raw sums, until the next change
        self._rows: list[tuple[torch.Tensor, torch.Tensor]] | None = []  # float32 (D, P), (O, P), while count < d
        self._rows_cache: tuple[np.ndarray, np.ndarray] | None = None
        self.count = 0

    def _zeros(self, device: torch.device | None = None) -> Sums:
        """Zero sums on ``device``."""
        d, o = self.d, self.o
        return tuple(torch.zeros(shape, dtype=torch.float64, device=device) for shape in ((d, d), (d, o), d, o, ()))

    def _to(self, device: torch.device) -> None:
        """Move the accumulators to `device` (where the inputs live), allocating them there first."""
        if self._sums is None:
            self._sums = self._zeros(device)
        elif self._sums[0].device != device:
            self._sums, self._cache = tuple(a.to(device) for a in self._sums), None
            if self._shift is not None:
                self._shift = (self._shift[0].to(device), self._shift[1].to(device))

    def update(self, x: np.ndarray | torch.Tensor, t: np.ndarray | torch.Tensor, scratch: Scratch | None = None,
               weight: torch.Tensor | None = None) -> None:
        """Add positions given as rows, x (P, D) and t (P, O), or channel-major, x (B, D, L) and
        t (B, O, L) with positions b·L + l (what im2col and NCHW tensors give without a copy). ``scratch``: where the
        chunks' GEMM operand is built (a loop's chunks reuse one). ``weight``: each position's, (P,) or (B, L),
        non-negative (the positions themselves are then not kept: ``rows`` is for unweighted sums)."""
        xf, tf = _as_float32_tensor(x), _as_float32_tensor(t)
        if xf.ndim == 2 and tf.ndim == 2:
            xf, tf = xf.T.unsqueeze(0), tf.T.unsqueeze(0)
        if (xf.ndim != 3 or tf.ndim != 3 or xf.shape[1] != self.d or tf.shape[1] != self.o
                or xf.shape[0] != tf.shape[0] or xf.shape[2] != tf.shape[2]):
            raise ValueError(
                f"ConsumerStats.update expects x (P, {self.d}) and t (P, {self.o}), or (B, {self.d}, L) and "
                f"(B, {self.o}, L); got {tuple(xf.shape)} and {tuple(tf.shape)}"
            )
        tf = tf.to(xf.device)
        self._to(xf.device)
        self._cache = None
        b, _, length = xf.shape
        if b * length == 0:  # a chunk that thinning left empty
            return
        kept = weight is None and self._rows is not None and self.count + b * length < self.d
        self._keep_rows([(xf.permute(1, 0, 2).reshape(self.d, b * length).clone(),
                          tf.permute(1, 0, 2).reshape(self.o, b * length).clone())] if kept else None, b * length)
        with torch.no_grad():
            if self._shift is None:
                self._shift = (_shift(xf), _shift(tf))
                self._shifted = (bool(self._shift[0].any()), bool(self._shift[1].any()))
            wf = None if weight is None else _as_float32_tensor(weight).to(xf.device).reshape(b, length).sqrt()
            if length >= CHUNK_ROWS // 16:
                for i in range(b):  # long positions axis: one GEMM per image and slice
                    for s in range(0, length, CHUNK_ROWS):
                        self._add(xf[i : i + 1, :, s : s + CHUNK_ROWS], tf[i : i + 1, :, s : s + CHUNK_ROWS], scratch,
                                  None if wf is None else wf[i : i + 1, s : s + CHUNK_ROWS])
            else:
                per = max(1, CHUNK_ROWS // length)
                for i in range(0, b, per):
                    self._add(xf[i : i + per], tf[i : i + per], scratch, None if wf is None else wf[i : i + per])
        self.count += b * length if wf is None else float((wf.double() ** 2).sum())

    def _add(self, x: torch.Tensor, t: torch.Tensor, scratch: Scratch | None, root: torch.Tensor | None = None
             ) -> None:
        """Accumulate one chunk, x (B, D, L) and t (B, O, L) (positions b·L + l), shifted, with a single float32 GEMM
        [x; 1]·[x; 1; t]ᵀ, each position's column times ``root`` (B, L), the square root of its weight, where given
        (tall-skinny products are dominated by call overhead; the ones give the sums, and tᵀt, which no caller needs,
        is never formed). The chunk is copied once, into the GEMM's operand (``scratch``'s
        buffer where given)."""
        d, o = self.d, self.o
        b, _, length = x.shape
        z = (scratch or Scratch()).take((d + 1 + o, b, length), x.device)
        z[:d].copy_(x.transpose(0, 1))
        z[d].fill_(1.0)
        z[d + 1 :].copy_(t.transpose(0, 1))
        if self._shifted[0]:
            z[:d] -= self._shift[0][:, None, None]
        if self._shifted[1]:
            z[d + 1 :] -= self._shift[1][:, None, None]
        if root is not None:
            z *= root[None]
        z = z.view(d + 1 + o, b * length)
        xx, xt, sx, st, tt = self._sums
        for r in range(0, d, GRAM_ROWS):  # xx's blocks on and above the diagonal; ``_mirrored`` fills the rest
            end = r + GRAM_ROWS if r + GRAM_ROWS < d else d + 1  # the ones' row never alone (a GEMV sums otherwise)
            rows = slice(r, min(end, d))
            part = (z[r:end] @ z[r:].T).double()  # [x; 1][r:end] · [x; 1; t][r:]ᵀ
            xx[rows, r:] += part[: rows.stop - r, : d - r]
            sx[rows] += part[: rows.stop - r, d - r]
            xt[rows] += part[: rows.stop - r, d + 1 - r :]
        st += part[-1, d + 1 - r :]  # the last block's last row is the ones' row
        tt += torch.sum(z[d + 1 :] * z[d + 1 :], dtype=torch.float64)

    def merge(self, other: ConsumerStats) -> None:
        """Add another accumulator's sums into this one (same D and O)."""
        if (other.d, other.o) != (self.d, self.o):
            raise ValueError(f"cannot merge ConsumerStats of dims {(other.d, other.o)} into {(self.d, self.o)}")
        if other._shift is None:
            return
        self._cache = None
        device = (self._sums or other._sums)[0].device
        if self._shift is None:
            self._shift = (other._shift[0].to(device), other._shift[1].to(device))
            self._shifted = other._shifted
        self._keep_rows(other._rows, other.count)
        theirs = tuple(a.to(device) for a in other._sums)
        dx, dt = ((b.to(device).double() - a.double()) for a, b in zip(self._shift, other._shift))
        moved = _moved(theirs, other.count, dx, dt)
        if self._sums is None:  # nothing here yet: theirs, as 0 + theirs would be (copied where still theirs)
            self._sums = tuple(m.clone() if m is t else m for m, t in zip(moved, theirs))
        else:
            for mine, add in zip(self._sums, moved):
                mine += add
        self.count += other.count

    def _keep_rows(self, rows: list[tuple[torch.Tensor, torch.Tensor]] | None, added: int) -> None:
        """Append ``rows`` (``added`` positions; None: not kept) while the count stays below D, else drop all."""
        self._rows_cache = None
        below = self._rows is not None and rows is not None and self.count + added < self.d
        self._rows = self._rows + rows if below else None

    @property
    def rows(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The positions, x (P, D) and t (P, O) float64, while there are fewer than D of them (else None)."""
        if self._rows is None or not self._rows:
            return None
        if self._rows_cache is None:
            self._rows_cache = tuple(torch.cat([r[i] for r in self._rows], dim=1).T.double().cpu().numpy()
                                     for i in range(2))
        return self._rows_cache

    def _raw(self) -> Sums:
        """The raw sums (computed once after each change: the refit reads them many times)."""
        if self._sums is None:
            self._sums = self._zeros()
        if self._cache is None:
            _mirrored(self._sums[0])
            self._cache = (_moved(self._sums, self.count, self._shift[0].double(), self._shift[1].double())
                           if any(self._shifted) else self._sums)
        return self._cache

    @property
    def xx(self) -> np.ndarray:
        """Σ_p x_p x_pᵀ, shape (D, D), float64."""
        return self._raw()[0].cpu().numpy()

    @property
    def xt(self) -> np.ndarray:
        """Σ_p x_p t_pᵀ, shape (D, O), float64."""
        return self._raw()[1].cpu().numpy()

    @property
    def sx(self) -> np.ndarray:
        """Σ_p x_p, shape (D,), float64."""
        return self._raw()[2].cpu().numpy()

    @property
    def st(self) -> np.ndarray:
        """Σ_p t_p, shape (O,), float64."""
        return self._raw()[3].cpu().numpy()

    @property
    def tt(self) -> float:
        """Σ_p ||t_p||², float64."""
        return float(self._raw()[4])


def neuron_gram(xx: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """G_ij = Σ_p <h_i(p), h_j(p)> = Σ_{a,b<K} (WᵀW)[iK+a, jK+b] · xx[iK+a, jK+b], shape (N, N)."""
    w = np.asarray(w, dtype=np.float64)
    d = w.shape[1]
    n = d // k
    g = np.empty((n, n))
    rows = max(1, _BLOCK_ELEMENTS // (d * k))  # channels per block
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        block = (w[:, i0 * k : i1 * k].T @ w) * xx[i0 * k : i1 * k]
        g[i0:i1] = block.reshape(i1 - i0, k, n, k).sum(axis=(1, 3))
    return g


def neuron_cross(
    xt: np.ndarray, sx: np.ndarray, w: np.ndarray, k: int, bias: np.ndarray | None = None
) -> np.ndarray:
    """c_i = Σ_p <h_i(p), t_p - bias> = Σ_{a,o} W[o, iK+a] (xt[iK+a, o] - sx[iK+a] bias[o]), shape (N,)."""
    w = np.asarray(w, dtype=np.float64)
    target = xt if bias is None else xt - np.outer(sx, bias)
    return np.einsum("od,do->d", w, target).reshape(-1, k).sum(axis=1)


def target_energy(tt: float, st: np.ndarray, count: int, bias: np.ndarray | None = None) -> float:
    """Σ_p ||t_p - bias||² = tt - 2 biasᵀst + count·||bias||²."""
    if bias is None:
        return float(tt)
    bias = np.asarray(bias, dtype=np.float64)
    return float(tt - 2.0 * bias @ st + count * bias @ bias)
