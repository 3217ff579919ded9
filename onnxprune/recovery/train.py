"""Training loops of recovery on cached tensors: plain torch, seeded, best held-out checkpoint kept."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import torch

from onnxprune.ir.store import Array, Store
from onnxprune.torch.engine import TorchGraph, device_of

Loss = Callable[[list[torch.Tensor], list[torch.Tensor]], torch.Tensor]
LR_TRIAL = 0.05  # of a loop's steps or seconds, each candidate learning rate's trial (``choose_lr``)
TRIALS_OVERRUN = 10  # trials that took this many times their seconds each (their held-out measures alone: YOLOv8s's
# head at 640², 34 s a trial of 0.2 s under a one-minute budget) and more than TRIALS_FLOOR seconds try no more rates
TRIALS_FLOOR = 10.0  # (below it the trials cost nothing a user waits for, whatever a loaded machine makes of them)
PATIENCE = 3  # held-out measures of a loop (of its ``evals``): where none of the first ones beats the start, the loop
# ends there and its time goes to the loops after it (MobileNetV2 170M's last block and its distillation kept their
# start after 280 of 855 seconds)


class Optimizer(StrEnum):
    """The update rule of recovery's training loops."""

    ADAM = "adam"
    TENSOR_ADAM = "tensor-adam"  # ``TensorAdam``


class TensorAdam(torch.optim.Optimizer):
    """Adam whose second moment is one number per tensor, the mean of its squared gradient (NovoGrad's normalisation,
    Ginsburg et al. 2019): a tensor's steps are as free of its gradient's scale as Adam's, but inside a tensor a weight
    whose gradient is small moves little, where Adam moves every weight by about the learning rate however little
    the training samples exercise it."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"], state["m"], state["v"] = 0, torch.zeros_like(p), p.new_zeros(())
                state["step"] += 1
                state["m"].lerp_(p.grad, 1 - b1)
                state["v"].lerp_(p.grad.pow(2).mean(), 1 - b2)
                m_hat = state["m"] / (1 - b1 ** state["step"])
                v_hat = state["v"] / (1 - b2 ** state["step"])
                p.add_(m_hat / (v_hat.sqrt() + group["eps"]), alpha=-group["lr"])


def optimizer_for(kind: Optimizer | str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The ``kind`` of update rule on ``params`` at ``lr``."""
    return TensorAdam(params, lr=lr) if Optimizer(kind) is Optimizer.TENSOR_ADAM else torch.optim.Adam(params, lr=lr)


@dataclass
class FitResult:
    held_before: float  # held-out loss of the starting weights
    held_after: float  # held-out loss of the weights kept (never above held_before)
    best_step: int  # step of the kept checkpoint (0: the starting weights)
    steps: int
    lr: float = 0.0  # the learning rate trained with
    trials: list[tuple[float, float]] = field(default_factory=list)  # (lr, held-out loss after its trial) where
    # the rate was chosen among candidates
    stopped: bool = False  # ended at its ``PATIENCE``-th held-out measure, none of them better than the start


def relative_mse(ys: list[torch.Tensor], ts: list[torch.Tensor]) -> torch.Tensor:
    """Σ_k ||y_k - t_k||² / ||t_k - mean t_k||² over the batch (scale-free across segments)."""
    total = ys[0].new_zeros(())
    for y, t in zip(ys, ts):
        total = total + ((y - t) ** 2).sum() / ((t - t.mean(dim=0)) ** 2).sum().clamp_min(1e-12)
    return total


def _feed(xs: Sequence[np.ndarray], idx: np.ndarray, device: torch.device) -> list[torch.Tensor]:
    return [torch.from_numpy(x[idx]).to(device) for x in xs]


def evaluate_net(net: TorchGraph, xs: Sequence[Array], idx: np.ndarray, batch_size: int,
                 store: Store | None = None, first: int | None = None) -> list[Array]:
    """The net's outputs (its ``first`` ones only, when given) on samples ``idx`` of the cached inputs ``xs`` (no
    gradients); in ``store``'s arrays when given, else in numpy arrays."""
    outs: list[Array] | None = None
    device = device_of(net)
    with torch.no_grad():
        for s in range(0, len(idx), batch_size):
            ys = [y.cpu().numpy() for y in net(*_feed(xs, idx[s : s + batch_size], device))[:first]]
            if outs is None:
                shapes = [(len(idx), *y.shape[1:]) for y in ys]
                outs = [np.empty(sh, y.dtype) if store is None else store.empty(sh, y.dtype)
                        for sh, y in zip(shapes, ys)]
            for out, y in zip(outs, ys):
                out[s : s + len(y)] = y
    return outs or []


def held_loss(net: TorchGraph, xs, ts, idx: np.ndarray, batch_size: int, loss: Loss) -> float:
    """``loss`` over all the samples ``idx`` (KL or relative squared error), accumulated batch by batch in float64:
    the held-out outputs are never all in memory at once."""
    device, sums = device_of(net), None
    with torch.no_grad():
        for s in range(0, len(idx), batch_size):
            chunk = idx[s : s + batch_size]
            ys = [y.double().cpu() for y in net(*_feed(xs, chunk, device))]
            targets = [torch.from_numpy(t[chunk]).double() for t in ts]
            part = loss.sums(ys, targets) if hasattr(loss, "sums") else _loss_sums(loss, ys, targets)
            sums = part if sums is None else [a + b for a, b in zip(sums, part)]
    if hasattr(loss, "combine"):  # a loss of sums additive over batches (``objective.DetectLoss``)
        return float(loss.combine(sums))
    if loss is kl_loss:
        return float(sums[0] / len(idx))
    total = 0.0
    for err, st, stt in zip(sums[0::3], sums[1::3], sums[2::3]):  # ||t - mean t||² = Σt² - (Σt)²/n per entry
        total += float(err / max(float(stt - (st**2).sum() / len(idx)), 1e-12))
    return total


def _loss_sums(loss: Loss, ys: list[torch.Tensor], ts: list[torch.Tensor]) -> list[torch.Tensor]:
    """What ``held_loss`` adds up per batch: the summed KL of the rows, or per output its squared error, the
    targets' sum over samples and their squared sum."""
    if loss is kl_loss:
        return [row_kl(ys[0], ts[0]).sum()]
    if loss is not relative_mse:
        raise ValueError("held_loss accumulates kl_loss or relative_mse")
    return [v for y, t in zip(ys, ts) for v in (((y - t) ** 2).sum(), t.sum(0), (t**2).sum())]


def row_kl(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """KL(t || y) of each row, the rows as probabilities (``log_probs``)."""
    lt, ly = log_probs(t), log_probs(y)
    return (lt.exp() * (lt - ly)).sum(1)


def kl_loss(ys: list[torch.Tensor], ts: list[torch.Tensor]) -> torch.Tensor:
    """Mean KL(t || y) of the first outputs' rows (``row_kl``)."""
    return row_kl(ys[0], ts[0]).mean()


def hardest(ys: torch.Tensor, ts: torch.Tensor, keep: int) -> torch.Tensor:
    """The indices of the ``keep`` rows where ``ys`` disagrees most with ``ts`` (``row_kl``), the largest first."""
    return torch.topk(row_kl(ys, ts), min(keep, len(ys))).indices


def softened_kl(temperature: float) -> Loss:
    """``kl_loss`` of the rows softened by ``temperature`` (their log-probabilities divided by it before a softmax),
    times its square, which keeps the gradients' scale (Hinton et al. 2015); 1: ``kl_loss`` itself."""
    if temperature == 1:
        return kl_loss

    def loss(ys: list[torch.Tensor], ts: list[torch.Tensor]) -> torch.Tensor:
        return temperature**2 * kl_loss([log_probs(ys[0]) / temperature], [log_probs(ts[0]) / temperature])

    return loss


def log_probs(x: torch.Tensor) -> torch.Tensor:
    """Row-wise log-probabilities: of the rows themselves when they are probabilities already (non-negative,
    summing to 1: a model that ends in Softmax), else their log-softmax (logits); ``tasks.log_probs`` on tensors."""
    with torch.no_grad():
        probabilities = bool((x >= 0).all()) and bool(torch.allclose(x.sum(1), torch.ones(len(x), dtype=x.dtype),
                                                                        atol=1e-3))
    return torch.log(x.clamp_min(1e-12)) if probabilities else torch.log_softmax(x, 1)


def _adam_step(opt: torch.optim.Optimizer, value: torch.Tensor, params: list[torch.nn.Parameter],
               start: list[torch.Tensor], pull: float) -> torch.Tensor:
    """One step of ``opt`` on ``value`` plus pull·Σ||θ - θ₀||²/||θ₀||² (decay towards the ``start``); the loss."""
    if pull > 0:
        value = value + pull * sum(((p - p0) ** 2).sum() / (p0**2).sum().clamp_min(1e-12)
                                   for p, p0 in zip(params, start))
    opt.zero_grad(set_to_none=True)
    value.backward()
    opt.step()
    return value


def _load(params: list[torch.nn.Parameter], weights: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, w in zip(params, weights):
            p.copy_(w)


def choose_lr(
    params: list[torch.nn.Parameter],
    batch_loss: Callable[[torch.Generator], torch.Tensor],
    held: Callable[[], float],
    lrs: Sequence[float],
    start: list[torch.Tensor],
    *,
    steps: int,
    seconds: float | None,
    pull: float,
    seed: int,
    optimizer: Optimizer | str = Optimizer.ADAM,
    on_step: Callable[[int, float], None] | None = None,
) -> tuple[list[tuple[float, float]], float, list[torch.Tensor]]:
    """Each of ``lrs`` trained from the ``start`` weights (the ``params``' values) on the same batches, at a constant
    rate for ``steps`` steps of ``optimizer`` (for ``seconds`` where given), then measured by ``held()``; ``start`` is
    loaded back after each. Returns (lr, held-out loss) per candidate, the winning (first lowest) rate and the weights
    its trial left. ``on_step(step, train_loss)`` counts the steps of all trials. Under ``seconds``, where the trials
    so far took ``TRIALS_OVERRUN`` times theirs and more than ``TRIALS_FLOOR``, the rates after them are not tried."""
    trials, done, best, chosen, kept = [], 0, math.inf, lrs[0], start
    first = time.monotonic()
    for k, lr in enumerate(lrs):
        spent = time.monotonic() - first
        if seconds is not None and k and spent > max(TRIALS_OVERRUN * seconds * k, TRIALS_FLOOR):
            break
        gen, opt = torch.Generator().manual_seed(seed), optimizer_for(optimizer, params, lr)
        begin, step = time.monotonic(), 0
        while step < steps if seconds is None else step == 0 or time.monotonic() - begin < seconds:
            step += 1
            value = _adam_step(opt, batch_loss(gen), params, start, pull)
            if on_step is not None:
                on_step(done + step, value.item())
        done += step
        trials.append((lr, held()))
        if trials[-1][1] < best:
            best, chosen, kept = trials[-1][1], lr, [p.detach().clone() for p in params]
        _load(params, start)
    return trials, chosen, kept


def train_loop(
    params: list[torch.nn.Parameter],
    batch_loss: Callable[[torch.Generator], torch.Tensor],
    held: Callable[[], float],
    *,
    steps: int,
    lr: float | Sequence[float],
    pull: float,
    seed: int,
    evals: int = 5,
    patience: int = PATIENCE,
    on_step: Callable[[int, float, float], None] | None = None,
    seconds: float | None = None,
    average: float = 0.0,
    optimizer: Optimizer | str = Optimizer.ADAM,
) -> FitResult:
    """``optimizer`` (Adam or ``TensorAdam``) with cosine decay on ``params`` minimising ``batch_loss(generator)``;
    the held-out loss ``held()`` is measured ``evals`` times and the best weights (the starting ones included) are
    left in ``params``. ``pull`` adds pull·Σ||θ - θ₀||²/||θ₀||² (decay towards the start).
    ``on_step(step, train_loss, best_held)`` reports progress.

    ``average`` > 0: the held-out measures and the weights kept are those of an exponential moving average of the
    trained weights (each step's weight ``1 - average``), not the last step's.

    With ``seconds``, the loop runs for that long instead of ``steps`` steps: the cosine and the checkpoints
    follow the share of the time spent (a held-out measure's time counted), the last one at the end.

    Where none of the first ``patience`` held-out measures beats the start, the loop ends there (``stopped``): the
    starting weights are kept, and a caller sharing a time budget gives what is left to its next loops.

    ``lr`` a sequence: the rate is the one whose trial (``choose_lr``, ``LR_TRIAL`` of the steps or seconds each)
    left the lowest held-out loss, and the loop goes on from the weights that trial left; under ``seconds`` the
    trials' time is the loop's. Where no trial beat the start, at any rate, the loop ends after them (``stopped``),
    with its start: MobileNetV2's head distillation, which never beat its start, spent a hundred seconds of its
    loop before its third measure said so."""
    begin = time.monotonic()
    start = [p.detach().clone() for p in params]
    best = held()
    trials, kept = [], start
    if not isinstance(lr, (int, float)):
        trials, lr, kept = choose_lr(params, batch_loss, held, lr, start, steps=max(1, round(steps * LR_TRIAL)),
                                     seconds=None if seconds is None else seconds * LR_TRIAL, pull=pull, seed=seed,
                                     optimizer=optimizer,
                                     on_step=None if on_step is None else lambda k, value: on_step(k, value, best))
        if seconds is not None:
            seconds = max(1.0, seconds - (time.monotonic() - begin))
            begin = time.monotonic()
    gen = torch.Generator().manual_seed(seed)
    result = FitResult(held_before=best, held_after=best, best_step=0, steps=steps, lr=float(lr), trials=trials)
    if trials and min(held for _, held in trials) >= best:
        result.steps, result.stopped = 0, True
        return result
    best_state = [p0.clone() for p0 in start]
    # the winning trial's held-out loss is the least of several on the same samples, biased low: its weights are a
    # start, not a checkpoint (kept, they lost a point of top-1 on MobileNetV2's test photos)
    _load(params, kept)
    mean = [p.detach().clone() for p in params] if average > 0 else None
    opt = optimizer_for(optimizer, params, lr)
    sched = None if seconds is not None else torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    checkpoints = {int(round(steps * (k + 1) / evals)) for k in range(evals)}
    done_evals, step = 0, 0
    while True:
        step += 1
        if seconds is not None:  # the share of the time spent sets the learning rate, as the step count does
            share = min(1.0, (time.monotonic() - begin) / seconds)
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * share))
        value = _adam_step(opt, batch_loss(gen), params, start, pull)
        if sched is not None:
            sched.step()
        if mean is not None:
            with torch.no_grad():
                for m, p in zip(mean, params):
                    m.lerp_(p, 1.0 - average)
        if seconds is None:
            check, last = step in checkpoints, step >= steps
        else:
            share = (time.monotonic() - begin) / seconds
            last = share >= 1.0
            check = last or share >= (done_evals + 1) / evals
        if check:
            done_evals += 1
            current = held() if mean is None else _held_at(params, mean, held)
            if current < best:
                best, result.best_step = current, step
                best_state = [p.detach().clone() for p in (params if mean is None else mean)]
            result.stopped = not last and result.best_step == 0 and done_evals >= patience
        if on_step is not None:
            on_step(step, value.item(), best)
        if last or result.stopped:
            break
    result.steps = step
    _load(params, best_state)
    result.held_after = best
    return result


def _held_at(params: list[torch.nn.Parameter], weights: list[torch.Tensor], held: Callable[[], float]) -> float:
    """``held()`` with ``weights`` in ``params``, which then hold their own values again."""
    own = [p.detach().clone() for p in params]
    _load(params, weights)
    try:
        return held()
    finally:
        _load(params, own)


def _draw(idx: np.ndarray, batch_size: int, gen: torch.Generator) -> np.ndarray:
    return idx[torch.randint(len(idx), (min(batch_size, len(idx)),), generator=gen).numpy()]


def fit(
    net: TorchGraph,
    params: list[torch.nn.Parameter],
    xs: Sequence[np.ndarray],
    ts: Sequence[np.ndarray],
    train_idx: np.ndarray,
    held_idx: np.ndarray,
    *,
    batch_size: int,
    loss: Loss = relative_mse,
    held_by: Loss | None = None,
    pool: int = 1,
    **loop,
) -> FitResult:
    """``train_loop`` on cached tensors: ``net(xs) ≈ ts`` on ``train_idx`` by ``loss``, checkpoints chosen on
    ``held_idx`` by ``held_by`` (None: ``loss``). ``pool`` > 1 (a classifier's first output): each batch is the
    ``batch_size`` of ``pool`` times as many samples drawn where the net disagrees most with ``ts`` (``hardest``)."""

    device = device_of(net)

    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        pick = _draw(train_idx, batch_size * pool, gen)
        if pool > 1:
            with torch.no_grad():
                ys, t = net(*_feed(xs, pick, device))[0], _feed(ts[:1], pick, device)[0]
                pick = pick[hardest(ys, t, batch_size).cpu().numpy()]
        return loss(list(net(*_feed(xs, pick, device))), _feed(ts, pick, device))

    return train_loop(params, batch_loss, lambda: held_loss(net, xs, ts, held_idx, batch_size, held_by or loss),
                      **loop)


def distill(
    student: TorchGraph,
    teacher: TorchGraph,
    params: list[torch.nn.Parameter],
    xs: Sequence[np.ndarray],
    train_idx: np.ndarray,
    held: Callable[[], float],
    *,
    batch_size: int,
    augment: Callable[[list[torch.Tensor], torch.Generator], list[torch.Tensor]],
    loss: Loss,
    pool: int = 1,
    **loop,
) -> FitResult:
    """``train_loop`` matching the teacher's outputs on augmented batches of ``xs[train_idx]``: the
    teacher runs on the same augmented inputs as the student, so nothing is cached. ``pool`` > 1 (a classifier's
    first output): ``pool`` times as many inputs are augmented and the batch keeps the ``batch_size`` of them where
    the student disagrees most with the teacher (``hardest``; both run on all of them without gradients)."""

    device = device_of(student)

    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        inputs = augment(_feed(xs, _draw(train_idx, batch_size * pool, gen), device), gen)
        with torch.no_grad():
            ts = list(teacher(*inputs))
            if pool > 1:
                keep = hardest(student(*inputs)[0], ts[0], batch_size)
                inputs, ts = [x[keep] for x in inputs], [t[keep] for t in ts]
        return loss(list(student(*inputs)), ts)

    return train_loop(params, batch_loss, held, **loop)
