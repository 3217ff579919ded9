"""Numeric verification of the rate (Ye, Wu & Liu 2020, appendix "Details on Numeric Verification of Rate").

The two-hidden-layer deep mean-field network of the appendix, F = F2 ∘ F1^N with

    F1^n(x) = 1/n Σ_{i≤n} a_{1,i} ReLU(B_{1,i}ᵀ x)     x ∈ R^100, B_{1,i} ∈ R^{100×50}, a_{1,i} ∈ R
    F2(z)   = 1/50 Σ_{j≤50} a_{2,j} ReLU(b_{2,j}ᵀ z)   z ∈ R^50,  b_{2,j} ∈ R^50,       a_{2,j} ∈ R

is trained on the appendix's 200 points, x ~ Unif[0,1]^100 and
y = (exp(w2/10) - 0.5)ᵀ tanh(sin(2π w1) x / 5) / 1000 with w1 (1000×100), w2 (1000) ~ Unif[0,1].
Every parameter starts from N(0, 1); training is full-batch gradient descent on ½·mean (F(x) - y)² in
the mean-field scaling (a neuron of a width-n layer moves by -lr·n·∂L/∂θ, so each neuron moves at a
rate independent of n), the same steps and step size for every network.

The trained network's first layer (N = 50 neurons) is then pruned to n neurons by
* local imitation: the paper's greedy on the layer-output loss (``onnxprune.imitation.local``);
* global imitation: the greedy on the final-output loss with step 1/(k+1), every step exact
  (``onnxprune.imitation.global_``, no Taylor shortlist, as in the appendix);
and, for comparison, an n-neuron network is trained from scratch with the same dynamics and the same
initialisation: its first layer starts from n of the full network's initial neurons (a random subset per
seed, D averaged over seeds) and its second layer from the full network's initial second layer, so D
measures the first layer's width alone (with independent second layers, their 50-neuron fluctuation
sets a floor of D that does not depend on n). The discrepancy is D = mean_x (f(x) - F(x))² over the 200 points. The paper's
claims: local imitation O(exp(-λn)), global imitation O(n^-2) (under extra assumptions), training
from scratch O(n^-1) (mean-field analysis). Both an exponential fit (slope of log D vs n) and a
power-law fit (slope of log D vs log n) are reported for every curve, with their R².

    python benchmarks/rate.py                # full run, writes benchmarks/results/rate.{json,md,png}
    python benchmarks/rate.py --quick        # tiny configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from paper_global import greedy_global
from onnxprune.imitation.local import greedy_local

DIM_IN, DIM_HIDDEN, WIDTH_2, N_POINTS = 100, 50, 50, 200
FIT_FLOOR = 1e-9
"""Points with D below FIT_FLOOR · D(n=1) are left out of the fits (float64 round-off of the greedy's
loss, not the rate, decides them)."""


@dataclass
class Net:
    """Parameters of F2 ∘ F1^n (float64 tensors): a1 (n,), B1 (100, n, 50) (B_{1,i} = B1[:, i]), a2 (50,),
    b2 (50, 50) (b_{2,j} = b2[j])."""

    a1: torch.Tensor
    B1: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor

    @property
    def width(self) -> int:
        return len(self.a1)

    def params(self) -> list[torch.Tensor]:
        return [self.a1, self.B1, self.a2, self.b2]

    def neurons(self, x: torch.Tensor) -> torch.Tensor:
        """First-layer neuron outputs σ(θ_i, x) = a_{1,i} ReLU(B_{1,i}ᵀ x), shape (points, n, 50)."""
        pre = (x @ self.B1.reshape(DIM_IN, -1)).reshape(len(x), self.width, DIM_HIDDEN)
        return self.a1[None, :, None] * torch.relu(pre)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """F2 on first-layer outputs z (..., 50) -> (...)."""
        return torch.relu(z @ self.b2.T) @ self.a2 / WIDTH_2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.neurons(x).mean(dim=1))


def generate_data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The appendix's 200 points (x, y) from its random generator network."""
    rng = np.random.default_rng([seed, 0])
    w1, w2 = rng.uniform(size=(1000, DIM_IN)), rng.uniform(size=1000)
    x = rng.uniform(size=(N_POINTS, DIM_IN))
    y = (np.exp(w2 / 10) - 0.5) @ np.tanh(np.sin(2 * np.pi * w1) @ x.T / 5) / 1000
    return torch.from_numpy(x), torch.from_numpy(y)


def init_net(n: int, seed: int) -> Net:
    """Every parameter i.i.d. N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)
    return Net(normal(n), normal(DIM_IN, n, DIM_HIDDEN), normal(WIDTH_2), normal(WIDTH_2, DIM_HIDDEN))


def subnet(net: Net, n: int, rng: np.random.Generator | None) -> Net:
    """A copy of ``net`` with n of its first-layer neurons (a random subset drawn by ``rng``; all when None)."""
    keep = torch.arange(net.width) if rng is None else torch.from_numpy(np.sort(rng.choice(net.width, n, replace=False)))
    return Net(net.a1[keep].clone(), net.B1[:, keep].clone(), net.a2.clone(), net.b2.clone())


def train(net: Net, x: torch.Tensor, y: torch.Tensor, *, lr: float, steps: int) -> float:
    """Full-batch mean-field gradient descent in float32 (2.5x faster than float64 here), written back
    into ``net`` in float64; returns the final training loss ½·mean (F - y)²."""
    params = [p.float().requires_grad_(True) for p in net.params()]
    scale = [net.width, net.width, WIDTH_2, WIDTH_2]  # per-neuron learning rate: lr × layer width
    x32, y32 = x.float(), y.float()
    for _ in range(steps):
        loss = 0.5 * (Net(*params)(x32) - y32).pow(2).mean()
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g, s in zip(params, grads, scale):
                p -= lr * s * g
    net.a1, net.B1, net.a2, net.b2 = (p.detach().double() for p in params)
    with torch.no_grad():
        return float(0.5 * (net(x) - y).pow(2).mean())


def discrepancy(f: torch.Tensor, target: torch.Tensor) -> float:
    """D = mean_x (f(x) - F(x))²."""
    return float((f - target).pow(2).mean())


def prune_local(net: Net, x: torch.Tensor, target: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Local imitation of the first layer: (D, layer-output loss D̄) at every width 1..N.

    The neurons' Gram matrix G_ij = mean_x <σ_i, σ_j> defines D̄(a) = aᵀGa - 2cᵀa + τ with the layer's
    own output as target (c = G·1/N, τ = 1ᵀG1/N²). Width n takes the greedy's best visited state with
    at most n neurons (a state with fewer is an n-neuron layer whose extra neurons carry weight 0).
    """
    s = net.neurons(x)
    n = net.width
    G = torch.einsum("mih,mjh->ij", s, s).numpy() / len(x)
    path = greedy_local(G, G.sum(axis=1) / n, float(G.sum()) / n**2, max_steps=20 * n, rel_tol=1e-14)
    curve = np.where(np.isfinite(path.curve[1:]), path.curve[1:], np.inf)
    best = [int(np.argmin(curve[:k])) + 1 for k in range(1, n + 1)]  # best visited support m ≤ k
    weights = torch.from_numpy(np.stack([path.weights(m) for m in best]))
    local = np.array([float(((s * w[None, :, None]).sum(1) - s.mean(1)).pow(2).sum(-1).mean()) for w in weights])
    outputs = net.head(torch.einsum("kn,mnh->kmh", weights, s))
    return np.array([discrepancy(o, target) for o in outputs]), local


def prune_global(net: Net, x: torch.Tensor, target: torch.Tensor) -> np.ndarray:
    """Global imitation of the first layer: D at every width 1..N (every support size is visited)."""
    s = net.neurons(x)
    n = net.width

    def losses(a: np.ndarray, step: int) -> np.ndarray:
        out = net.head(torch.einsum("kn,mnh->kmh", torch.from_numpy(a), s))
        return (out - target).pow(2).mean(dim=1).numpy()

    path = greedy_global(losses, None, n, n, max_steps=40 * n)
    reached = int(path.supports.max())
    return np.array([path.curve[k] if k <= reached else np.nan for k in range(1, n + 1)])


def fit(widths: np.ndarray, d: np.ndarray) -> dict:
    """Least-squares fits of log D: exponential (vs n; rate λ in D ~ e^{-λn}) and power law (vs log n;
    exponent p in D ~ n^{-p}), with R², over the finite points above FIT_FLOOR · D at the smallest width
    and below the full width N (where pruning keeps every neuron: D is rounding, not the curve)."""
    widths, d = np.asarray(widths, dtype=float), np.asarray(d, dtype=float)
    ok = np.isfinite(d) & (d > 0) & (widths < DIM_HIDDEN)
    if ok.any():
        ok &= d > FIT_FLOOR * d[ok][0]
    if ok.sum() < 3:
        return {"points": int(ok.sum()), "exp_rate": None, "exp_r2": None, "power": None, "power_r2": None}
    n, y = widths[ok], np.log(d[ok])
    out: dict = {"points": int(ok.sum()), "n_range": [int(n.min()), int(n.max())]}
    for key, t in (("exp", n), ("power", np.log(n))):
        slope, icept = np.polyfit(t, y, 1)
        resid = y - (slope * t + icept)
        r2 = 1.0 - float(resid @ resid) / max(float(((y - y.mean()) ** 2).sum()), np.finfo(float).tiny)
        out[f"{key}_rate" if key == "exp" else key] = float(-slope)
        out[f"{key}_r2"] = r2
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"Full network: N = {cfg['N']} first-layer neurons, trained {cfg['steps']} steps at lr {cfg['lr']} "
        f"(training loss {result['full_train_loss']:.3g}; Var y = {result['var_y']:.3g}). "
        f"Scratch: mean over {cfg['seeds']} seeds; diverged runs (left out): "
        f"{sum(result['scratch']['diverged'])}.",
        "",
        "| n | local imitation D | local D̄ (layer output) | global imitation D | scratch D |",
        "|---|---|---|---|---|",
    ]
    scratch = dict(zip(result["scratch"]["n"], result["scratch"]["mean"]))
    for i, n in enumerate(result["n"]):
        if n in cfg["table_n"]:
            s = f"{scratch[n]:.3g}" if n in scratch else "–"
            lines.append(f"| {n} | {result['local'][i]:.3g} | {result['local_layer'][i]:.3g} "
                         f"| {result['global'][i]:.3g} | {s} |")
    lines += ["", "| curve | paper's claim | exp. rate λ (D ~ e^-λn) | R² | power p (D ~ n^-p) | R² | fitted n |",
              "|---|---|---|---|---|---|---|"]
    claims = {"local": "O(e^-λn)", "local_layer": "O(e^-λn) (the greedy's own loss)", "global": "O(n^-2)",
              "scratch": "O(n^-1)"}
    for name, claim in claims.items():
        f = result["fits"][name]
        if f["exp_rate"] is None:
            lines.append(f"| {name} | {claim} | – | – | – | – | {f['points']} points |")
            continue
        lines.append(f"| {name} | {claim} | {f['exp_rate']:.3f} | {f['exp_r2']:.3f} | {f['power']:.2f} "
                     f"| {f['power_r2']:.3f} | {f['n_range'][0]}–{f['n_range'][1]} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Left: D of the whole network vs n; right: local imitation's own (layer-output) loss. Dashed: fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = np.array(result["n"])
    sn, mean = np.array(result["scratch"]["n"]), np.array(result["scratch"]["mean"])
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.semilogy(n, result["local"], "o-", ms=3, label="local imitation")
    ax.semilogy(n, result["global"], "s-", ms=3, label="global imitation")
    ax.semilogy(sn, mean, "^-", ms=4, label="trained from scratch (mean)")
    ax2.semilogy(n, result["local_layer"], "o-", ms=3, label="local imitation: layer-output loss D̄")

    def fit_line(axis, name: str, x: np.ndarray, y: np.ndarray, style: str, exponential: bool) -> None:
        f = result["fits"][name]
        if f["exp_rate"] is None:
            return
        lo, hi = f["n_range"]
        sel = (x >= lo) & (x <= hi) & np.isfinite(y) & (y > 0)
        t = np.linspace(lo, hi, 50)
        u, ut = (x[sel], t) if exponential else (np.log(x[sel]), np.log(t))
        c = np.polyfit(u, np.log(y[sel]), 1)
        label = f"fit e^(-{f['exp_rate']:.2f} n), R² {f['exp_r2']:.2f}" if exponential else \
            f"fit n^(-{f['power']:.2f}), R² {f['power_r2']:.2f}"
        axis.semilogy(t, np.exp(np.polyval(c, ut)), style, lw=1, label=label)

    fit_line(ax, "local", n, np.array(result["local"]), "C0--", True)
    fit_line(ax, "scratch", sn, mean, "C2--", False)
    fit_line(ax2, "local_layer", n, np.array(result["local_layer"]), "C0--", True)
    ax.set_ylabel("discrepancy D of the network to the full one")
    ax.set_title(f"Rate: pruning N = {result['config']['N']} neurons vs training n")
    ax2.set_ylabel("layer-output loss of the pruned first layer")
    ax2.set_title("What local imitation minimises")
    for axis in (ax, ax2):
        axis.set_xlabel("neurons n in the first hidden layer")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--steps", type=int, default=6000, help="gradient steps of every training run")
    parser.add_argument("--lr", type=float, default=0.1,
                        help="step size (per neuron, mean-field scaled; at 0.15 every ReLU dies)")
    parser.add_argument("--scratch-n", default="1,2,4,8,16,32", 
                        help="widths trained from scratch (n = N would be the full network itself)")
    parser.add_argument("--seeds", type=int, default=2, help="scratch networks per width (D averaged)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny run: 300 steps, 3 scratch widths, 1 seed")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="refit and redraw rate.md/rate.png in --out from a rate.json, nothing retrained")
    args = parser.parse_args()
    if args.from_json:
        write(json.loads(args.from_json.read_text()), args.out)
        return
    if args.quick:
        args.steps, args.scratch_n, args.seeds = 300, "1,4,16", 1
    torch.set_num_threads(1)  # small products: one thread is faster on a busy 2-core machine
    start = time.perf_counter()
    x, y = generate_data(args.seed)
    init = init_net(DIM_HIDDEN, args.seed)
    full = subnet(init, DIM_HIDDEN, None)
    full_loss = train(full, x, y, lr=args.lr, steps=args.steps)
    with torch.no_grad():
        target = full(x)
        local, local_layer = prune_local(full, x, target)
        global_ = prune_global(full, x, target)
    print(f"full network trained: loss {full_loss:.3g} ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
    scratch_n = [int(v) for v in args.scratch_n.split(",")]
    runs = []
    for n in scratch_n:
        d = []
        for s in range(args.seeds):
            net = subnet(init, n, np.random.default_rng([args.seed, s, n]))
            train(net, x, y, lr=args.lr, steps=args.steps)
            with torch.no_grad():
                d.append(discrepancy(net(x), target))
        runs.append(d)
        print(f"scratch n={n}: D = {np.mean(d):.3g}", file=sys.stderr, flush=True)
    widths = np.arange(1, DIM_HIDDEN + 1)
    # A small network can diverge at this step size (its neurons are not averaged): such runs are
    # counted and left out of the mean.
    mean = [float(np.mean([v for v in d if np.isfinite(v)])) if np.isfinite(d).any() else float("nan")
            for d in runs]
    result = {
        "config": {"N": DIM_HIDDEN, "points": N_POINTS, "steps": args.steps, "lr": args.lr, "seeds": args.seeds,
                   "seed": args.seed, "quick": args.quick, "table_n": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 50]},
        "full_train_loss": full_loss,
        "var_y": float(y.var()),
        "n": widths.tolist(),
        "local": local.tolist(),
        "local_layer": local_layer.tolist(),
        "global": [float(v) for v in global_],
        "scratch": {"n": scratch_n, "runs": runs, "mean": mean,
                    "diverged": [int((~np.isfinite(d)).sum()) for d in runs]},
        "seconds": time.perf_counter() - start,
    }
    write(result, args.out)


def write(result: dict, out: Path) -> None:
    """Fit the curves of ``result`` and write rate.json, rate.md and rate.png to ``out``."""
    widths = np.array(result["n"])
    result["fits"] = {name: fit(widths, result[name]) for name in ("local", "local_layer", "global")}
    result["fits"]["scratch"] = fit(result["scratch"]["n"], result["scratch"]["mean"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "rate.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / "rate.md").write_text(table)
    plot(result, out / "rate.png")
    print(table)


if __name__ == "__main__":
    main()
