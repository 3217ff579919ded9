"""The paper's global imitation, as research code outside the product (the benchmarks that redo the paper's
figures and the tests import it; ``onnxprune`` does not).

``greedy_global`` (Ye, Wu & Liu 2020, sec. 2.3 and appendix "Details on Taylor Approximation Tricks"): a group
of N channels is scaled by a simplex weight vector a: channel i of the consumers' input is multiplied by N·a_i
(a = 1/N is the original network). Global imitation chooses a to minimise the discrepancy D(a) between the
network's final output and the original one, greedily:

* k = 0: the best single neuron a = e_i (every i evaluated exactly);
* k >= 1, γ_k = 1/(k+1): a <- (1-γ_k) a + γ_k e_i with the best i. While k <= ``exact_until``
  every i is evaluated exactly; afterwards the Taylor trick ranks the neurons by
  gr_i = 2 Σ_j (1[j=i] - a_j) r_j, r = ∂D/∂b at b = 0 for the auxiliary mask N·(a + b) (one
  backward pass), and only the ``shortlist`` best-ranked (smallest gr_i: steepest descent) are
  evaluated exactly.

The algorithm only sees two callbacks (``losses`` and ``grad``), so it is testable without a network;
``DownstreamObjective`` builds them from an ONNX graph: it runs only the part of the graph after a cut
(``TorchGraph`` with ``inputs_at`` = the tensors alive there, cached for every calibration sample), with the
group's channels scaled in flight, and scores

* ``loss="kl"``: KL(softmax(original) || softmax(pruned)) per sample for 2-D outputs (logits),
  mean squared error for any other output;
* ``loss="mse"``: mean squared error (over the non-batch elements) for every output;

summed over outputs and averaged over the samples. Every step draws one seeded mini-batch (shared by all
candidates of the step and its gradient); K candidates × B samples are stacked into one forward pass (chunked
to at most ``max_rows`` rows).

With γ_k = 1/(k+1) the weights are always counts / (k+1) (how often each neuron was picked), so a is kept as
exact integer counts: supports only grow, by at most one channel a step, and every support size from 1 to the
final one is visited.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch

from onnxprune.errors import CalibrationError, ModelError
from onnxprune.imitation.path import WidthPath
from onnxprune.ir.store import DiskArray
from onnxprune.torch.engine import TorchGraph

LOSSES = ("kl", "mse")
MEMORY_BYTES = 2 << 30
"""Default activation budget of one forward pass (sets ``max_rows``)."""
ACTIVATION_FACTOR = 16
"""Assumed peak activation bytes of the downstream graph per byte of cut tensors (a heuristic:
MobileNet's 6x expansions with two tensors alive, plus slack)."""

LossFn = Callable[[np.ndarray, int], np.ndarray]
"""losses(A, step): A is (K, N) candidate simplex weights; returns the K discrepancies (same
mini-batch for every row of one step)."""

GradFn = Callable[[np.ndarray, int], np.ndarray]
"""grad(a, step): r = ∂D/∂b at b = 0 (N,) for the mask N·(a + b), on the step's mini-batch."""



def taylor_scores(a: np.ndarray, r: np.ndarray) -> np.ndarray:
    """gr_i = 2 Σ_j (1[j=i] - a_j) r_j = 2 (r_i - aᵀr): the derivative of D along a -> e_i
    (scaled by the paper's factor 2); smaller is a steeper descent."""
    r = np.asarray(r, dtype=np.float64)
    return 2.0 * (r - float(np.asarray(a, dtype=np.float64) @ r))


@dataclass(kw_only=True)
class GlobalPath(WidthPath):
    """Trace of one greedy global run.

    losses[k], supports[k]: loss (on step k's mini-batch) and support size after k steps
    (k = 0 is the best single neuron). picks[k]: the neuron added/re-weighted at step k.
    exact[k]: whether step k evaluated every neuron (False: Taylor shortlist).
    curve[n], best[n], weights/support/padded: see WidthPath.
    order: channels in the order they first entered the support.
    final: the weights a where the greedy stopped. evaluations: candidate evaluations in total.
    Padding channels are the unselected ones with the best (smallest) Taylor score gr_i (one extra
    `grad` call on the mini-batch of the step that reached that state, cached); without a `grad`
    callback the lowest unselected indices pad.
    """

    losses: np.ndarray
    supports: np.ndarray
    picks: np.ndarray
    exact: np.ndarray
    order: np.ndarray
    final: np.ndarray
    evaluations: int
    best_step: dict[int, int] = field(repr=False)
    """support size -> the step at which best[n] was reached (its mini-batch pads it)."""
    grad: GradFn | None = field(default=None, repr=False)
    _scores: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def _pad_scores(self, m: int, a: np.ndarray) -> np.ndarray:
        if m not in self._scores:
            grad = self.grad(a, self.best_step[m]) if self.grad is not None else None
            self._scores[m] = taylor_scores(a, grad) if grad is not None else np.zeros(len(a))
        return self._scores[m]


def _evaluate(losses: LossFn, cands: np.ndarray, step: int, chunk: int) -> np.ndarray:
    out = []
    for s in range(0, len(cands), chunk):
        part = cands[s : s + chunk]
        v = np.asarray(losses(part, step), dtype=np.float64).reshape(-1)
        if len(v) != len(part):
            raise ValueError(f"losses callback returned {len(v)} values for {len(part)} candidates")
        out.append(v)
    return np.concatenate(out)


def greedy_global(
    losses: LossFn,
    grad: GradFn | None,
    n_channels: int,
    max_width: int,
    *,
    exact_until: int = 25,
    shortlist: int = 5,
    max_steps: int | None = None,
    chunk: int = 256,
) -> GlobalPath:
    """Greedy global imitation over the simplex of ``n_channels`` weights.

    ``losses(A, step)`` evaluates the discrepancy of the K candidate weight vectors in A (K, N),
    all on the same mini-batch for a given ``step`` (it is called with at most ``chunk`` rows at
    a time); ``grad(a, step)`` returns r = ∂D/∂b at b = 0 for the mask N·(a + b) (with
    ``grad=None`` every step is exact). Step 0 picks the best single neuron; step k >= 1
    moves to (1-γ)a + γ e_i, γ = 1/(k+1), with the best i among all N (k <= exact_until) or among
    the ``shortlist`` neurons with the smallest Taylor score gr_i (later steps). Stops once the
    support reaches ``max_width`` (or N), or after ``max_steps`` steps (default 3·max_width).
    """
    n = int(n_channels)
    if n < 1:
        raise ValueError(f"n_channels must be positive, got {n}")
    if not 1 <= max_width <= n:
        raise ValueError(f"max_width {max_width} outside [1, {n}]")
    if shortlist < 1:
        raise ValueError(f"shortlist must be positive, got {shortlist}")
    chunk = max(int(chunk), 1)
    max_steps = 3 * max_width if max_steps is None else int(max_steps)

    eye = np.eye(n)
    vals = _evaluate(losses, eye, 0, chunk)
    i0 = int(np.argmin(vals))
    evaluations = n
    counts = np.zeros(n, dtype=np.int64)
    counts[i0] = 1
    a = counts / 1.0
    cur = float(vals[i0])
    losses_, supports, picks, exact, order = [cur], [1], [i0], [True], [i0]
    curve = np.full(n + 1, np.inf)
    curve[1] = cur
    best = {1: a.copy()}
    best_step = {1: 0}
    support = 1

    step = 0
    while support < max_width and step < max_steps:
        step += 1
        total = step + 1  # Σ counts after this step; γ = 1/total
        if step <= exact_until or grad is None:
            idx = np.arange(n)
            is_exact = True
        else:
            r = np.asarray(grad(a, step), dtype=np.float64).reshape(-1)
            if len(r) != n:
                raise ValueError(f"grad callback returned {len(r)} values for {n} channels")
            idx = np.sort(np.argsort(taylor_scores(a, r), kind="stable")[: min(shortlist, n)])
            is_exact = False
        cands = np.repeat(counts[None, :].astype(np.float64), len(idx), axis=0)
        cands[np.arange(len(idx)), idx] += 1.0
        cands /= total
        vals = _evaluate(losses, cands, step, chunk)
        evaluations += len(idx)
        j = int(np.argmin(vals))
        i = int(idx[j])
        if counts[i] == 0:
            order.append(i)
            support += 1
        counts[i] += 1
        a = counts / float(total)
        cur = float(vals[j])
        losses_.append(cur)
        supports.append(support)
        picks.append(i)
        exact.append(is_exact)
        if cur < curve[support]:
            curve[support] = cur
            best[support] = a.copy()
            best_step[support] = step

    return GlobalPath(
        losses=np.array(losses_),
        supports=np.array(supports),
        picks=np.array(picks),
        exact=np.array(exact),
        curve=curve,
        order=np.array(order),
        final=a,
        evaluations=evaluations,
        best=best,
        best_step=best_step,
        grad=grad,
    )


class DownstreamObjective:
    """D(a) of one channel group from the cached tensors at its cut.

    model: the network (the pruned prefix may differ from the original; only the part after the
    cut is evaluated). cut_values: every tensor alive at the cut, (samples, ...) each.
    channel_tensors: (tensor name, channel axis) pairs the mask multiplies (the consumers'
    inputs; a tensor read by other nodes too is scaled for those as well). An axis of size
    N·R (e.g. a Flatten before a Gemm) takes each channel's factor on R consecutive entries.
    reference: the original network's outputs for the same samples (graph output name ->
    array); these are the outputs evaluated. n_channels: N, by default the axis size of the
    first channel tensor (give it when that tensor is flattened).
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        cut_values: Mapping[str, np.ndarray],
        channel_tensors: Sequence[tuple[str, int]],
        reference: Mapping[str, np.ndarray],
        *,
        loss: str = "kl",
        batch_size: int | None = 64,
        seed: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        n_channels: int | None = None,
        max_rows: int | None = None,
    ) -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} not in {LOSSES}")
        if not cut_values:
            raise ValueError("cut_values is empty: give the tensors alive at the cut")
        if not channel_tensors:
            raise ValueError("channel_tensors is empty: name the tensor(s) whose channels the mask scales")
        if not reference:
            raise ValueError("reference is empty: give the original network's outputs")
        counts = {name: len(v) for name, v in {**cut_values, **reference}.items()}
        if len(set(counts.values())) != 1:
            raise CalibrationError(
                f"cut values and reference outputs hold different sample counts {counts}: cache them "
                "from the same calibration samples"
            )
        self.n_samples = next(iter(counts.values()))
        if self.n_samples == 0:
            raise CalibrationError("no calibration samples at the cut")
        self.loss = loss
        self.batch_size = self.n_samples if batch_size is None else max(1, min(int(batch_size), self.n_samples))
        self.seed = int(seed)
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.channel_tensors = [(str(t), int(ax)) for t, ax in channel_tensors]
        for name, axis in self.channel_tensors:
            if axis == 0:
                raise ValueError(f"channel axis of {name!r} is 0, the sample axis: give the channel axis")

        self._cut = {k: v if isinstance(v, DiskArray) else np.asarray(v) for k, v in cut_values.items()}
        self.output_names = list(reference)
        self.graph = TorchGraph(
            model,
            outputs=self.output_names,
            inputs_at=list(self._cut),
            hooks={name: self._hook(name, axis) for name, axis in self.channel_tensors},
        )
        missing = [n for n in self.graph.input_names if n not in self._cut]
        if missing:
            raise ModelError(
                f"the graph after the cut also reads {missing}, which are not among the cut values: "
                "cache every tensor alive at the cut (Liveness.live)"
            )
        self.graph.requires_grad_(False)
        self.graph.to(device=self.device, dtype=dtype)
        # the network's outputs, small next to the cut tensors: held whole (v[:] reads a spilled one back)
        self._ref = {k: torch.as_tensor(np.asarray(v[:])).to(self.device, dtype) for k, v in reference.items()}
        self._logp = {k: torch.log_softmax(v, dim=-1) for k, v in self._ref.items() if self._kl(v)}

        # N and the per-tensor repeats: from the cut values, else from one probing sample
        self._mask: torch.Tensor | None = None
        self._sizes: dict[str, int] = {
            name: int(self._cut[name].shape[axis]) for name, axis in self.channel_tensors if name in self._cut
        }
        self._fired: set[str] = set()
        self._probing = True
        try:
            with torch.no_grad():
                out = self.graph.run(self._feeds(np.arange(1)))
        finally:
            self._probing = False
        unused = [name for name, _ in self.channel_tensors if name not in self._fired]
        if unused:
            raise ModelError(
                f"channel tensor(s) {unused} are not evaluated after the cut: name the consumers' inputs "
                "downstream of the cut values"
            )
        for k, v in out.items():
            if tuple(v.shape[1:]) != tuple(self._ref[k].shape[1:]):
                raise ModelError(
                    f"output {k!r} has per-sample shape {tuple(v.shape[1:])} after the cut but the "
                    f"reference has {tuple(self._ref[k].shape[1:])}: give the reference of the same outputs"
                )
        first = self._sizes[self.channel_tensors[0][0]]
        self.n_channels = int(n_channels) if n_channels is not None else first
        self._repeat: dict[str, int] = {}
        for name, size in self._sizes.items():
            if size % self.n_channels:
                raise ValueError(
                    f"channel axis of {name!r} has {size} entries, not a multiple of {self.n_channels} channels"
                )
            self._repeat[name] = size // self.n_channels

        if max_rows is None:
            per_sample = sum(v[:1].nbytes for v in self._cut.values()) * torch.finfo(dtype).bits // 32
            max_rows = MEMORY_BYTES // max(per_sample * ACTIVATION_FACTOR, 1)
        self.max_rows = max(int(max_rows), 1)
        self._batch_cache: tuple[int, tuple[np.ndarray, dict[str, torch.Tensor]]] | None = None

    # ------------------------------------------------------------------ internals

    def _kl(self, ref: torch.Tensor) -> bool:
        return self.loss == "kl" and ref.dim() == 2

    def _hook(self, name: str, axis: int):
        def hook(t: torch.Tensor) -> torch.Tensor:
            ax = axis + t.dim() if axis < 0 else axis
            if self._probing:
                self._fired.add(name)
                self._sizes.setdefault(name, int(t.shape[ax]))
                return t
            m = self._mask  # (rows or 1, N)
            rep = self._repeat[name]
            if rep > 1:
                m = m.repeat_interleave(rep, dim=1)
            shape = [1] * t.dim()
            shape[0], shape[ax] = m.shape[0], m.shape[1]
            return t * m.reshape(shape).to(t.dtype)

        return hook

    def batch(self, step: int) -> np.ndarray:
        """Sample indices (sorted) of ``step``'s mini-batch: all samples when the batch covers
        them, else ``batch_size`` drawn without replacement, seeded by (seed, step)."""
        if self.batch_size >= self.n_samples:
            return np.arange(self.n_samples)
        rng = np.random.default_rng([self.seed, int(step)])
        return np.sort(rng.choice(self.n_samples, self.batch_size, replace=False))

    def _feeds(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        out = {}
        for name, v in self._cut.items():
            t = torch.as_tensor(np.ascontiguousarray(v[idx]))
            out[name] = t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device)
        return out

    def _step_feeds(self, step: int) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        if self._batch_cache is None or self._batch_cache[0] != step:
            idx = self.batch(step)
            self._batch_cache = (step, (idx, self._feeds(idx)))
        return self._batch_cache[1]

    def _per_sample(self, out: Mapping[str, torch.Tensor], idx: torch.Tensor, k: int) -> torch.Tensor:
        """Per-sample discrepancy (k, B) of outputs stacked candidate-major (k·B rows)."""
        total = None
        for name, y in out.items():
            y = y.reshape(k, len(idx), *y.shape[1:])
            ref = self._ref[name][idx]
            if name in self._logp:
                logp = self._logp[name][idx]
                d = (logp.exp() * (logp - torch.log_softmax(y, dim=-1))).sum(-1)
            else:
                d = (y - ref).pow(2).reshape(k, len(idx), -1).mean(-1)
            total = d if total is None else total + d
        return total

    def _forward(self, feeds: Mapping[str, torch.Tensor], masks: torch.Tensor) -> dict[str, torch.Tensor]:
        """Outputs for the K masks (K, N) on the B samples of ``feeds``, rows candidate-major."""
        k = masks.shape[0]
        b = len(next(iter(feeds.values())))
        if k == 1:
            self._mask = masks
            stacked = feeds
        else:
            self._mask = masks.repeat_interleave(b, dim=0)
            stacked = {n: t.repeat(k, *([1] * (t.dim() - 1))) for n, t in feeds.items()}
        try:
            return self.graph.run(stacked)
        finally:
            self._mask = None

    # ------------------------------------------------------------------ callbacks

    def losses(self, candidates: np.ndarray, step: int) -> np.ndarray:
        """D of each candidate weight vector (K, N) on ``step``'s mini-batch, (K,) float64."""
        a = np.atleast_2d(np.asarray(candidates, dtype=np.float64))
        if a.shape[1] != self.n_channels:
            raise ValueError(f"candidates have {a.shape[1]} weights, the group {self.n_channels} channels")
        idx, feeds = self._step_feeds(step)
        tidx = torch.as_tensor(idx, device=self.device)
        masks = torch.as_tensor(a * self.n_channels).to(self.device, self.dtype)
        per = max(self.max_rows // len(idx), 1)
        out = np.empty(len(a))
        with torch.no_grad():
            for s in range(0, len(a), per):
                m = masks[s : s + per]
                d = self._per_sample(self._forward(feeds, m), tidx, len(m))
                out[s : s + len(m)] = d.mean(1).double().cpu().numpy()
        return out

    def grad(self, a: np.ndarray, step: int) -> np.ndarray:
        """r = ∂D/∂b at b = 0 for the mask N·(a + b), on ``step``'s mini-batch, (N,) float64."""
        a = np.asarray(a, dtype=np.float64).reshape(-1)
        idx, feeds = self._step_feeds(step)
        b = torch.zeros(self.n_channels, device=self.device, dtype=self.dtype, requires_grad=True)
        base = torch.as_tensor(a).to(self.device, self.dtype)
        n = len(idx)
        with torch.enable_grad():
            for s in range(0, n, self.max_rows):
                part = {k: v[s : s + self.max_rows] for k, v in feeds.items()}
                rows = len(next(iter(part.values())))
                mask = (self.n_channels * (base + b))[None, :]
                tidx = torch.as_tensor(idx[s : s + rows], device=self.device)
                d = self._per_sample(self._forward(part, mask), tidx, 1)
                (d.sum() / n).backward()
        return b.grad.double().cpu().numpy()

    def full_loss(self, a: np.ndarray) -> float:
        """D(a) on all samples (for reporting)."""
        masks = torch.as_tensor(np.asarray(a, dtype=np.float64).reshape(1, -1) * self.n_channels).to(
            self.device, self.dtype)
        total = 0.0
        with torch.no_grad():
            for s in range(0, self.n_samples, self.max_rows):
                idx = np.arange(s, min(s + self.max_rows, self.n_samples))
                d = self._per_sample(self._forward(self._feeds(idx), masks), torch.as_tensor(idx, device=self.device), 1)
                total += float(d.sum().double())
        return total / self.n_samples
