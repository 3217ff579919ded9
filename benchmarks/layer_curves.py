"""Error curves per layer (the paper's per-layer figure) on the real ImageNet MobileNetV2.

Every layer-wise prunable channel group is pruned ALONE (the rest of the network original), to n
kept channels, by
* local imitation: the paper's greedy on the layer-output loss (``onnxprune.imitation.local``), with
  its simplex weights folded into the consumers;
* L1: the n filters of largest L1 norm, consumers untouched;
* random: n channels drawn at random (seeded), consumers untouched;
and the relative layer-output loss ||Σ_i a_i h_i - F_ℓ||² / ||F_ℓ||² of the consumers' outputs is
recorded (the same streamed statistics for the three; L1/random have a_i = 1/N on the kept
channels). An exponential fit of local imitation's curve (slope of log loss vs n) gives each
layer's rate λ, with its R² (is the curve exponential at all?).

Global imitation (the greedy on the final output's KL to the original, step 1/(k+1), exact for
the first ``--exact-until`` steps then the paper's Taylor shortlist of 5) evaluates the whole
downstream network for every candidate channel, so on a CPU it runs only for ``--global-layers``,
on ``--global-photos`` photos, up to ``--global-width`` kept channels. For those layers the
final-output KL of the local, L1 and random choices is measured on the same photos, so the four
methods are compared on one scale.

    python benchmarks/layer_curves.py             # writes benchmarks/results/layer_curves.{json,md,png}
    python benchmarks/layer_curves.py --quick     # random-weight MobileNetV3-small, noise inputs (tests)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from common import DEFAULT_DATA, original_model
from common import run as run_cmd
from onnxprune.analysis import consumers
from onnxprune.calib.sources import ArraySet, CalibrationSet, load_calibration
from onnxprune.pipeline import Compressor, schedule
from onnxprune.strategies import L1, Random, Ratio, options_from
from paper_global import DownstreamObjective, greedy_global
from onnxprune.imitation.local import greedy_local, loss
from onnxprune.imitation.gram import ConsumerStats, neuron_gram
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.cuts import run_segment
from rate import fit

METHODS = ("local", "l1", "random")
COLORS = {"local": "C0", "global": "C1", "l1": "C2", "random": "C3"}


def widths_grid(n: int, points: int) -> np.ndarray:
    """Every width up to 8, then ``points`` evenly spaced widths up to n."""
    return np.unique(np.concatenate([np.arange(1, min(n, 8) + 1), np.linspace(1, n, points).round()])).astype(int)


def gram(run: Compressor, group, values: dict[str, np.ndarray]) -> np.ndarray:
    """G_ij = Σ_p <h_i(p), h_j(p)> over the group's consumers on the original network's cached tensors."""
    nodes = {node.name: node for node in run.original.nodes}
    G = np.zeros((group.channels, group.channels))
    bs = run.options.batch_size
    values = run.peek(run.original, values, {use.tensor for use in group.consumers})  # SE gates: read after the cut
    for use in group.consumers:
        node = nodes[use.node]
        lin = consumers.matrix(node)
        stats = ConsumerStats(lin.weight.shape[1], 0)
        x = values[use.tensor]
        for s in range(0, len(x), bs):
            cols = consumers.unfold(node, torch.from_numpy(x[s : s + bs]))
            stats.update(cols, cols[:, :0])
        G += neuron_gram(stats.xx, lin.weight, lin.k * use.repeat)
    return G


def selections(run: Compressor, group, G: np.ndarray, widths: np.ndarray, seed: int) -> dict[str, list[np.ndarray]]:
    """Simplex weights a (N,) of every method at every width (a = 1/N on the kept channels for L1/random)."""
    n = group.channels
    path = greedy_local(G, G.sum(axis=1) / n, float(G.sum()) / n**2)
    out: dict[str, list[np.ndarray]] = {"local": [path.weights(int(w)) for w in widths]}
    for method, select in (("l1", L1()), ("random", Random(seed))):
        out[method] = []
        for w in widths:  # the L1 ranking and the seeded draw read no statistics
            a = np.zeros(n)
            a[select.select(run, group, [], int(w))[0]] = 1.0 / n
            out[method].append(a)
    return out


def global_curves(run: Compressor, group, values: dict[str, np.ndarray], G: np.ndarray,
                  args: argparse.Namespace) -> dict:
    """Final-output KL vs width up to ``--global-width``: global imitation's greedy path, and the
    other methods' choices."""
    photos = {k: v[: args.global_photos] for k, v in values.items()}
    inputs = {k: v[: args.global_photos] for k, v in run.inputs.items()}
    outputs = [t.name for t in run.original.outputs]
    reference, _ = run_segment(run.original, inputs, outputs, provider="cpu", batch_size=run.options.batch_size)
    objective = DownstreamObjective(
        gs.export_onnx(run.original), photos, [(use.tensor, group.tensors[use.tensor][0]) for use in group.consumers],
        reference, batch_size=None, n_channels=group.channels, device="cpu",
    )
    top = min(group.channels, args.global_width)
    widths = widths_grid(top, args.points)
    t0 = time.perf_counter()
    path = greedy_global(objective.losses, objective.grad, group.channels, top, exact_until=args.exact_until)
    seconds = time.perf_counter() - t0
    kl = {"global": [float(path.curve[w]) for w in widths]}
    picks = selections(run, group, G, widths, args.seed)
    for method in METHODS:
        kl[method] = [objective.full_loss(a) for a in picks[method]]
    return {"widths": widths.tolist(), "kl": kl, "seconds": seconds, "evaluations": path.evaluations,
            "exact_steps": int(path.exact.sum()), "steps": len(path.exact)}


def calibration(args: argparse.Namespace, model: onnx.ModelProto) -> CalibrationSet:
    specs = model_input_specs(model)
    if args.quick:
        name, dims, _ = specs[0]
        x = np.random.default_rng(0).standard_normal((args.samples, *dims[1:])).astype(np.float32)
        return ArraySet({name: x}, np.arange(args.samples), {name: np.dtype(np.float32)})
    return load_calibration(args.data, specs, subset=args.subset, limit=args.samples)


def markdown(result: dict) -> str:
    lines = [
        "| layer | channels | local: λ per channel | R² | λ·N | rel. loss at N/4 (local / L1 / random) | "
        "at N/2 (local / L1 / random) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["layers"]:
        f = r["fit"]
        n, widths = r["channels"], np.array(r["widths"])

        def at(w: int) -> str:
            i = int(np.argmin(np.abs(widths - w)))
            return " / ".join(f"{r['loss'][m][i]:.3g}" for m in METHODS)

        rate = (f"{f['exp_rate']:.4f} | {f['exp_r2']:.2f} | {f['exp_rate'] * n:.1f}" if f["exp_rate"] is not None
                else "– | – | –")
        lines.append(f"| {r['name']} | {n} | {rate} | {at(n // 4)} | {at(n // 2)} |")
    for r in result["layers"]:
        g = r.get("global")
        if g is None:
            continue
        lines += ["", f"Final-output KL, {r['name']} ({r['channels']} channels; global imitation: {g['steps']} steps, "
                  f"{g['exact_steps']} exact, {g['seconds']:.0f} s, {result['config']['global_photos']} photos):", "",
                  "| kept | global | local | L1 | random |", "|---|---|---|---|---|"]
        for i, w in enumerate(g["widths"]):
            lines.append(f"| {w} | " + " | ".join(f"{g['kl'][m][i]:.3g}" for m in ("global", *METHODS)) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(r, "loss") for r in result["layers"]] + [(r, "kl") for r in result["layers"] if "global" in r]
    cols = 6
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3 * cols, 2.4 * rows), squeeze=False)
    for ax, (r, kind) in zip(axes.flat, panels):
        if kind == "loss":
            for m in METHODS:
                ax.semilogy(r["widths"], np.maximum(r["loss"][m], 1e-12), color=COLORS[m], lw=1, label=m)
            ax.set_title(f"{r['short']} (N={r['channels']}) λ·N={r['fit']['exp_rate'] * r['channels']:.1f}"
                         if r["fit"]["exp_rate"] is not None else r["short"], fontsize=7)
        else:
            g = r["global"]
            for m in ("global", *METHODS):
                ax.semilogy(g["widths"], g["kl"][m], color=COLORS[m], lw=1, label=m)
            ax.set_title(f"KL of output: {r['short']}", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [plt.Line2D([], [], color=COLORS[m]) for m in ("local", "global", "l1", "random")]
    fig.legend(handles, ["local imitation", "global imitation", "L1", "random"], loc="lower right", fontsize=9)
    fig.suptitle("Relative layer-output loss vs kept channels (log y); last panels: final-output KL", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def short_name(name: str) -> str:
    """'/features/features.3/conv/conv.0/conv.0.0/Conv' -> 'features.3/conv.0.0'."""
    parts = [p for p in name.split("/") if p][:-1]
    return f"{parts[1]}/{parts[-1]}" if len(parts) > 2 else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="ONNX model (default: the real MobileNetV2, built on first use)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photos for the statistics")
    parser.add_argument("--subset", default="::4", help="photos used (onnxprune --subset syntax)")
    parser.add_argument("--samples", type=int, default=128, help="at most this many photos")
    parser.add_argument("--points", type=int, default=24, help="evenly spaced widths per layer (plus 1..8)")
    parser.add_argument("--global-layers", default="-2,-1",
                        help="indices (in graph order, negative from the end) of the layers global imitation runs on; '' for "
                             "none")
    parser.add_argument("--global-photos", type=int, default=8, help="photos of global imitation's objective")
    parser.add_argument("--global-width", type=int, default=96, help="global imitation runs up to this width")
    parser.add_argument("--exact-until", type=int, default=25, help="exact global steps before the Taylor shortlist")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="tiny run: random-weight MobileNetV3-small, 4 noise inputs, global on the last layer")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.model = args.out / "layer_curves_quick.onnx"
        run_cmd([sys.executable, "-m", "models", "mobilenet_v3_small", "--weights", "random", "-o", str(args.model)])
        args.samples, args.points, args.global_layers, args.global_photos = 4, 6, "-1", 2
        args.global_width, args.exact_until = 6, 3
    elif args.model is None:
        if not args.data.is_dir():
            sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
        args.model = original_model(args.out)
    start = time.perf_counter()
    model = onnx.load(str(args.model))
    # The budget is not spent: the run only streams statistics, then L1 and Random choose on it.
    run = Compressor(model, calibration(args, model), options_from(Ratio(0.5), provider="cpu"))
    order, _ = schedule(run.analysis, run.live)
    global_layers = {int(v) % len(order) for v in args.global_layers.split(",") if v.strip()}
    values = dict(run.inputs)
    layers = []
    for i, (cut, group) in enumerate(order):
        t0 = time.perf_counter()
        run.advance(run.original, values, cut)
        G = gram(run, group, values)
        n = group.channels
        tau = float(G.sum()) / n**2
        widths = widths_grid(n, args.points)
        picks = selections(run, group, G, widths, args.seed)
        rel = {m: [loss(G, G.sum(axis=1) / n, tau, a) / tau for a in picks[m]] for m in METHODS}
        row = {"index": i, "name": group.name, "short": short_name(group.name), "channels": n,
               "widths": widths.tolist(), "loss": rel, "fit": fit(widths, rel["local"])}
        if i in global_layers:
            row["global"] = global_curves(run, group, values, G, args)
        row["seconds"] = time.perf_counter() - t0
        layers.append(row)
        print(f"[{i + 1}/{len(order)}] {row['short']} N={n}: λ={row['fit']['exp_rate']} "
              f"({row['seconds']:.1f} s)", file=sys.stderr, flush=True)
    result = {
        "config": {"model": str(args.model), "data": str(args.data), "subset": args.subset,
                   "samples": len(next(iter(run.inputs.values()))), "global_layers": sorted(global_layers),
                   "global_photos": args.global_photos, "global_width": args.global_width,
                   "exact_until": args.exact_until, "quick": args.quick, "seed": args.seed},
        "layers": layers,
        "seconds": time.perf_counter() - start,
    }
    (args.out / "layer_curves.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (args.out / "layer_curves.md").write_text(table)
    plot(result, args.out / "layer_curves.png")
    print(table)


if __name__ == "__main__":
    main()
