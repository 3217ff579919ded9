"""Held-out fidelity against minutes of recovery: MobileNetV2 at each MAC target, and detectors from
``detectors.py`` runs (the ``default`` and ``recover`` variants, one run per ``--recover-time``).

MobileNetV2 follows the protocol of ``recovery.py``: `compress` (defaults) on the 300 dev photos index % 5 not in
{0, 1}; `recover --time T` (defaults otherwise) on the same photos, the 100 photos index % 5 == 1 picking checkpoints;
every model scored on the 100 photos index % 5 == 0 that nothing saw. The x axis is the measured wall time of
each `recover` (0: the pruned model). Writes ``<out>/<name>.json``, ``.md`` and ``.png``.

    python benchmarks/recovery_curve.py --targets 170M --times 1m,5m,15m,30m --name curve_170M
    python benchmarks/recovery_curve.py --targets 170M --times 1m,5m,15m --fold 1 --name curve_170M_f1
    python benchmarks/recovery_curve.py --plot-only benchmarks/results/recovery_curve/curve_170M.json \\
        benchmarks/results/recovery_curve/curve_245M.json \\
        --detectors benchmarks/results/detectors_recover/detectors.json,benchmarks/results/detectors_recover_5m/detectors.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common import DEFAULT_DATA, split_flags, split_of, compress, evaluate, original_model, recover, recover_subsets


def measure(data: Path, out: Path, targets: list[str], times: list[str], fold: int = 0,
            classes: int | None = None, done: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """One row per (target, time): the wall seconds of `recover` (0 for the pruned model) and the test scores of
    ``fold``, or of the class-range split ``classes`` (``common.recover_subsets``); ``done(rows)`` after each."""
    original = original_model(out)
    train, held, test = recover_subsets(fold, classes)
    split = split_of(fold, classes)
    rows = []
    for target in targets:
        pruned, recovered = out / f"curve_{target}.onnx", out / f"curve_{target}_recovered.onnx"
        compress(original, pruned, data, ["--subset", train, "--target-flops", target])
        series = f"MobileNetV2 {target}"
        rows.append({"series": series, **split, "seconds": 0.0, **evaluate(pruned, original, data, test)})
        for limit in times:
            start = time.perf_counter()
            report = recover(pruned, original, recovered, data, ["--subset", train, "--held-subset", held, "--time",
                                                                 limit])
            rows.append({"series": series, **split, "time": limit, "seconds": time.perf_counter() - start,
                         "rounds": max((s["round"] for s in report["segments"]), default=0),
                         **evaluate(recovered, original, data, test)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            done(rows)
        pruned.unlink()
        recovered.unlink(missing_ok=True)
    return rows


def detector_rows(paths: list[Path]) -> list[dict]:
    """The ``default`` (0 s) and ``recover`` rows of ``detectors.py`` results, their command's seconds as x."""
    rows = []
    for path in paths:
        for r in json.loads(path.read_text())["rows"]:
            if r["variant"] in ("default", "recover"):
                rows.append({"series": f"{r['model']} {r['ratio']:g}×", "seconds": 0.0 if r["variant"] == "default"
                             else r["compress_s"], "mAP50-95_ref": r["metrics"]["mAP50-95_ref"]})
    unique = {(r["series"], round(r["seconds"])): r for r in rows}  # the pruned model appears once per run
    return sorted(unique.values(), key=lambda r: (r["series"], r["seconds"]))


def series(row: dict) -> str:
    """A row's curve: its model, and its fold or class-range split where it names one."""
    return row["series"] + "".join(f", {key} {row[key]}" for key in ("fold", "classes") if key in row)


def markdown(rows: list[dict]) -> str:
    lines = ["| model | recover minutes (measured) | top-1 | agreement | KL | mAP50-95 vs original |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        def cell(key: str, fmt: str) -> str:
            return format(r[key], fmt) if key in r else "–"
        lines.append(f"| {series(r)} | {r['seconds'] / 60:.1f} | {cell('top1', '.1%')} | {cell('agreement', '.1%')} "
                     f"| {cell('kl', '.3f')} | {cell('mAP50-95_ref', '.3f')} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, label) for key, label in (("top1", "top-1 (100 unseen photos)"), ("kl", "KL(original ‖ pruned)"),
                                              ("mAP50-95_ref", "mAP50-95 vs original (held-out)"))
              if any(key in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for name in dict.fromkeys(map(series, rows)):
            points = sorted((r["seconds"] / 60, r[key]) for r in rows if series(r) == name and key in r)
            if points:
                ax.plot(*zip(*points), marker="o", label=name)
        ax.set_xlabel("recover wall minutes (2-core CPU)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_curve"))
    parser.add_argument("--targets", default="245M,170M")
    parser.add_argument("--times", default="5m,15m,30m", help="the recover --time of each point")
    parser.add_argument("--name", default="curve", help="stem of the result files")
    split_flags(parser)
    parser.add_argument("--detectors", default="", help="comma-separated detectors.json files to plot beside")
    parser.add_argument("--plot-only", nargs="*", type=Path, help="draw these result files (no measurement)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.plot_only is not None:
        rows = [r for path in args.plot_only for r in json.loads(path.read_text())["rows"]]
    else:
        if not args.data.is_dir():
            sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
        result = args.out / f"{args.name}.json"
        rows = measure(args.data, args.out, args.targets.split(","), args.times.split(","), args.fold, args.classes,
                       lambda rows: result.write_text(json.dumps({"args": sys.argv[1:], "rows": rows}, indent=2)))
    rows += detector_rows([Path(p) for p in args.detectors.split(",") if p])
    (args.out / f"{args.name}.md").write_text(markdown(rows))
    plot(rows, args.out / f"{args.name}.png")
    print(markdown(rows))


if __name__ == "__main__":
    main()
