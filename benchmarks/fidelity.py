"""Fidelity vs MACs on the real ImageNet MobileNetV2, no fine-tuning.

For every MAC target and variant (a set of `onnxprune compress` flags) it compresses, evaluates
top-1/top-5, agreement and KL against the original on held-out photos, and writes
`<out>/fidelity.json` and `<out>/fidelity.md`. With `--folds K` (K ≤ 5) fold k calibrates on the
dev photos whose index % 5 != k and evaluates on those with index % 5 == k; the table pools the
K held-out sets (K=5: every photo evaluated once, by a model that never saw it). `--class-splits 0,2` splits by
class range instead: split k evaluates on the 125 photos of classes 250k..250k+249 and calibrates on the other 375.

    python benchmarks/fidelity.py --data ../shared/data/imagenet-sample-dev
    python benchmarks/fidelity.py --quick          # tiny configuration, used by the test suite
    python benchmarks/fidelity.py --plot-only benchmarks/results/fidelity.json   # redraw a committed run

Every run (and `--plot-only FILE...`) also draws top-1 and agreement vs MACs, one line per
variant, next to its JSON (`fidelity.json` -> `fidelity.png`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import matplotlib
import numpy as np

from common import DEFAULT_DATA, compress, evaluate, macs as count_macs, original_model

# The variants after "default" were measured on the ε allocation (the default before issue 18) and keep it.
EPS = ["--allocation", "epsilon"]
VARIANTS: dict[str, list[str]] = {
    "default": [],
    "no flip": ["--no-flip"],  # the default before mirrored calibration (2026-12-02)
    "output + streams": ["--residual-streams"],
    "output + blocks": ["--remove-blocks"],
    "local on output": ["--method", "local"],
    "global": ["--method", "global"],
    "auto": ["--method", "auto"],
    "epsilon allocation": EPS,
    "epsilon + streams": [*EPS, "--residual-streams"],
    "local": ["--method", "local", *EPS],
    "local paper fold": ["--method", "local", "--target", "paper", "--reconstruct", "none", *EPS],
    "local scale": ["--method", "local", "--reconstruct", "scale", *EPS],
    "l1": ["--method", "l1", "--reconstruct", "none", *EPS],
    "l1 + refit": ["--method", "l1", *EPS],
    "random": ["--method", "random", "--reconstruct", "none", *EPS],
    "uniform allocation": ["--allocation", "uniform"],
    "curve allocation": ["--allocation", "curve"],
    "no rounding": ["--round-to", "1", *EPS],
    "round to 16": ["--round-to", "16", *EPS],
    "flip": ["--flip", *EPS],
}


def pool(results: list[dict]) -> dict:
    """Image-weighted means of the per-fold metrics."""
    n = np.array([r["images"] for r in results], dtype=float)
    keys = ("top1", "top5", "agreement", "kl")
    return {"images": int(n.sum()), **{k: float(np.dot(n, [r[k] for r in results]) / n.sum()) for k in keys}}


def series(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped by variant, each group sorted by MACs: one plotted line per variant."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["variant"], []).append(r)
    return {name: sorted(group, key=lambda r: r["macs"]) for name, group in out.items()}


def plot(lines: dict[str, list[dict]], original: dict, path: Path, title: str,
         points: dict[str, list[dict]] | None = None) -> None:
    """Top-1 and agreement vs MACs: one line per entry of ``lines``, single markers for ``points``."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for ax, key, label in zip(axes, ("top1", "agreement"), ("top-1", "agreement with the original")):
        ax.axhline(original[key], color="grey", ls=":", lw=1)
        ax.plot([original["macs"] / 1e6], [original[key]], "k*", ms=9, label="original")
        for name, rows in lines.items():
            ax.plot([r["macs"] / 1e6 for r in rows], [r[key] for r in rows], "o-", label=name)
        for name, rows in (points or {}).items():
            ax.plot([r["macs"] / 1e6 for r in rows], [r[key] for r in rows], "D", mfc="none", ms=8, mew=1.5,
                    label=name)
        ax.set(xlabel="MACs (M)", ylabel=label, ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_file(result: Path) -> Path:
    """Redraw the plot of a fidelity results JSON next to it (``x.json`` -> ``x.png``)."""
    data = json.loads(result.read_text())
    png = result.with_suffix(".png")
    images = data["original"]["images"]
    plot(series(data["rows"]), data["original"], png,
         f"Real ImageNet MobileNetV2, no fine-tuning, {images} held-out photos ({result.name})")
    return png


def markdown(rows: list[dict], original: dict) -> str:
    lines = [
        "| target | variant | MACs | top-1 | top-5 | agreement | KL | compress s (mean) |",
        "|---|---|---|---|---|---|---|---|",
        f"| – | original | {original['macs'] / 1e6:.1f}M | {original['top1']:.1%} | {original['top5']:.1%} "
        "| 100% | 0 | – |",
    ]
    for r in rows:
        lines.append(f"| {r['target']} | {r['variant']} | {r['macs'] / 1e6:.1f}M | {r['top1']:.1%} | {r['top5']:.1%} "
                     f"| {r['agreement']:.1%} | {r['kl']:.3f} | {r['compress_seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--targets", default="270M,245M,220M,170M")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated among: {list(VARIANTS)}")
    parser.add_argument("--folds", type=int, default=1, help="cross-validation folds (1-5)")
    parser.add_argument("--class-splits", default="", help="class-range splits instead of --folds, e.g. '0,2'")
    parser.add_argument("--extra", default="", help="flags added to every compress, e.g. '--flip'")
    parser.add_argument("--quick", action="store_true", help="tiny run: 16 calibration and 10 held-out photos")
    parser.add_argument("--keep-reports", action="store_true",
                        help="keep each compress report as <out>/reports/<target>_<variant>_fold<k>.json (spaces in the variant as -)")
    parser.add_argument("--plot-only", type=Path, nargs="+", metavar="FILE",
                        help="redraw the plots of these results JSONs and exit (nothing is recomputed)")
    args = parser.parse_args()
    if args.plot_only:
        for result in args.plot_only:
            print(plot_file(result))
        return
    folds = [(f"!{k}%5", f"{k}%5") for k in range(args.folds)]
    if args.class_splits:
        folds = [(f"!{125 * k}:{125 * (k + 1)}", f"{125 * k}:{125 * (k + 1)}")
                 for k in map(int, args.class_splits.split(","))]
    if args.quick:
        folds, args.targets, args.variants = [("0:16", "100:110")], "245M", "default,l1"
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    base = pool([evaluate(original, original, args.data, held) for _, held in folds])
    base["macs"] = count_macs(original)
    rows = []
    for target in args.targets.split(","):
        for variant in args.variants.split(","):
            flags = VARIANTS[variant] + shlex.split(args.extra)
            results, seconds, macs = [], [], []
            for k, (calib, held) in enumerate(folds):
                pruned, report = args.out / "pruned.onnx", args.out / "pruned.json"
                compress(original, pruned, args.data, ["--subset", calib, "--target-flops", target, *flags], report)
                results.append(evaluate(pruned, original, args.data, held))
                rep = json.loads(report.read_text())
                seconds.append(rep["seconds"])
                macs.append(rep["macs_after"])
                pruned.unlink()
                if args.keep_reports:
                    (args.out / "reports").mkdir(exist_ok=True)
                    report.replace(args.out / "reports" / f"{target}_{variant.replace(' ', '-')}_fold{k}.json")
                else:
                    report.unlink()
            rows.append({"target": target, "variant": variant, "flags": flags, "macs": max(macs),
                         "compress_seconds": float(np.mean(seconds)), **pool(results)})
            print(markdown(rows[-1:], base).splitlines()[-1], file=sys.stderr, flush=True)
            (args.out / "fidelity.json").write_text(json.dumps({"original": base, "rows": rows}, indent=2))
    plot_file(args.out / "fidelity.json")
    table = markdown(rows, base)
    (args.out / "fidelity.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
