"""The paper's per-layer comparison of local and global imitation (its VGG-11 figure), redone with our refit.

Each of the last ``--groups`` prunable channel groups of the real MobileNetV2 is pruned ALONE (the rest of the
network original) to several widths, by
* omp: the group orthogonal matching pursuit (``compress``'s default selection);
* local: the paper's greedy local imitation of the layer output;
* global: shortlisted global imitation of the final output (``--method global``: the OMP's best, each candidate
  with its consumers refitted, judged through the rest of the network);
every choice then has its consumers refitted as ``compress`` writes them (least squares, cross-validated ridge
towards the original weights). The final-output KL to the original network and the top-1 agreement are measured
on ``--test`` photos the pruner did not see (calibration: ``--calib``). Prints and writes
``<out>/curves.{json,md,png}``.

    python benchmarks/method_curves.py
    python benchmarks/method_curves.py --plot-only benchmarks/results/method_curves/curves.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx

from common import DEFAULT_DATA, original_model
from layer_curves import short_name
from onnxprune.calib.sources import load_calibration
from onnxprune.tasks import log_probs
from onnxprune.pipeline import Compressor, schedule
from onnxprune.ir.ort import make_session, model_input_specs
from onnxprune.strategies import OMP, Global, Local, Ratio, options_from

METHODS = {"omp": OMP(), "local": Local(), "global": Global()}
COLORS = {"omp": "C0", "local": "C2", "global": "C1"}


def outputs(model: onnx.ModelProto, x: dict[str, np.ndarray]) -> np.ndarray:
    session, _ = make_session(model, "cpu", arena=False)
    return session.run(None, x)[0].astype(np.float64)


def kl_and_agreement(ref: np.ndarray, out: np.ndarray) -> tuple[float, float]:
    log_p, log_q = log_probs(ref), log_probs(out)
    kl = float(np.mean(np.sum(np.exp(log_p) * (log_p - log_q), axis=1)))
    return kl, float(np.mean(ref.argmax(1) == out.argmax(1)))


def measure(args: argparse.Namespace) -> dict:
    path = original_model(args.out)
    model = onnx.load(path)
    specs = model_input_specs(model)
    calib = load_calibration(str(args.data), specs, subset=args.calib)
    test_set = load_calibration(str(args.data), specs, subset=args.test)
    test = {k: np.concatenate([b[k] for b in test_set.batches(64)]) for k in test_set.input_names}
    reference = outputs(model, test)
    run = Compressor(model, calib, options_from(Ratio(0.5), provider="cpu"))
    order, _ = schedule(run.analysis, run.live)
    layers = []
    for cut, group in order[-args.groups:]:
        run.advance(run.graph, run.values_p, cut)
        run.advance(run.original, run.values_o, cut)
        need = {c.tensor for c in group.consumers}
        data = run.collect(group, run.peek(run.graph, run.values_p, need), run.peek(run.original, run.values_o, need))
        widths = sorted({max(1, int(round(r * group.channels))) for r in args.ratios}, reverse=True)
        layer = {"name": group.name, "channels": group.channels, "widths": widths, "kl": {}, "agreement": {},
                 "seconds": {}}
        for method, select in METHODS.items():
            layer["kl"][method], layer["agreement"][method], layer["seconds"][method] = [], [], []
            for width in widths:
                t0 = time.perf_counter()
                keep, _, _ = select.select(run, group, data, width)
                seconds = time.perf_counter() - t0
                whole = run.graph.copy()
                run.apply(group, data, keep, np.ones(width))
                kl, agree = kl_and_agreement(reference, outputs(run.export(), test))
                run.graph = whole
                run.notes.clear()
                layer["kl"][method].append(kl)
                layer["agreement"][method].append(agree)
                layer["seconds"][method].append(seconds)
                print(f"{group.name} {method} {width}/{group.channels}: KL {kl:.4f}, agreement {agree:.1%}, "
                      f"selection {seconds:.1f} s", flush=True)
        layers.append(layer)
    return {"config": {"calib": args.calib, "test": args.test, "calibration_photos": len(calib),
                       "test_photos": len(test_set), "ratios": args.ratios, "global": Global().describe()},
            "layers": layers}


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"Each group pruned alone; consumers refitted; KL(original ‖ pruned) and top-1 agreement on "
             f"{c['test_photos']} photos not used for calibration ({c['calibration_photos']} calibration photos).",
             "", "| group | kept | KL omp | KL local | KL global | agreement omp / local / global | global s |",
             "|---|---|---|---|---|---|---|"]
    for r in result["layers"]:
        for i, w in enumerate(r["widths"]):
            kls = " | ".join(f"{r['kl'][m][i]:.4f}" for m in METHODS)
            agree = " / ".join(f"{r['agreement'][m][i]:.0%}" for m in METHODS)
            lines.append(f"| {short_name(r['name'])} | {w}/{r['channels']} | {kls} | {agree} | "
                         f"{r['seconds']['global'][i]:.0f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = result["layers"]
    fig, axes = plt.subplots(1, len(layers), figsize=(3 * len(layers), 2.8), squeeze=False)
    for ax, r in zip(axes.flat, layers):
        for m in METHODS:
            ax.semilogy(r["widths"], r["kl"][m], "o-", color=COLORS[m], lw=1, ms=3, label=m)
        ax.set_title(f"{short_name(r['name'])} (N={r['channels']})", fontsize=8)
        ax.set_xlabel("kept channels", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3, which="both")
    axes.flat[0].set_ylabel("final-output KL (held-out photos)", fontsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("MobileNetV2, one group pruned at a time, consumers refitted: omp vs local vs global imitation",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--calib", default="!0%5", help="calibration photos (--subset syntax)")
    parser.add_argument("--test", default="0%5", help="photos the pruner does not see")
    parser.add_argument("--groups", type=int, default=6, help="the last this many groups")
    parser.add_argument("--ratios", type=lambda s: [float(x) for x in s.split(",")], default=[0.75, 0.5, 0.25, 0.125])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/method_curves"))
    parser.add_argument("--plot-only", type=Path, metavar="JSON")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only:
        result = json.loads(args.plot_only.read_text())
    else:
        t0 = time.perf_counter()
        result = measure(args)
        result["seconds"] = time.perf_counter() - t0
        (args.out / "curves.json").write_text(json.dumps(result, indent=2))
    (args.out / "curves.md").write_text(markdown(result))
    plot(result, args.out / "curves.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
