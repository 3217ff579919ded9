"""The corpus verdict "the default at least as good as ``--method l1``" pooled over calibration folds: each fold is a
``third_party.py`` run of the same models on other calibration photos (the same held-out ones), and a model's verdict
compares the two methods' output rel-L2 (and task metric) averaged over the folds that measured both. One fold of 64
random-weight photos decides near-ties by chance: RepVGG-A0's output rel-L2 moved 0.11–0.26 between folds, and which
method won with it (notebook, "One calibration fold decides a near-tie").

    python benchmarks/third_party.py --calib-subset 200:264 --out benchmarks/results/corpus_made_fold2 \\
        --data ../shared/data/imagenet-sample-dev --models "<names>"
    python benchmarks/pooled.py benchmarks/results/corpus_made benchmarks/results/corpus_made_fold2 \\
        --out benchmarks/results/corpus_made/pooled.md
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from third_party import METHODS, mean_rel_l2, small, task_metric

FIELDS = ("rel_l2", "task")


def fold_values(row: dict) -> dict[str, dict[str, float | None]] | None:
    """{method: {"rel_l2": mean over outputs, "task": the task metric or None}} of one fold's row (None where a
    method did not compress)."""
    if not all(m in row for m in METHODS):
        return None
    values = {}
    for m in METHODS:
        metric = task_metric(row[m])
        values[m] = {"rel_l2": mean_rel_l2(row[m]), "task": None if metric is None else metric[1]}
    return values


def pooled(folds: list[dict[str, dict]]) -> list[dict]:
    """Per model measured on every fold: each method's mean rel-L2 and task metric over the folds, the folds' own
    verdicts by rel-L2, and the pooled verdicts (default ≤ l1 by rel-L2; ≥ by the task metric where it has one)."""
    rows = []
    for name in folds[0]:
        measured = [fold_values(f[name]) for f in folds if name in f]
        if len(measured) < len(folds) or any(v is None for v in measured):
            continue
        mean = {m: {k: None if any(v[m][k] is None for v in measured) else
                    sum(v[m][k] for v in measured) / len(measured) for k in FIELDS} for m in METHODS}
        default, l1 = METHODS
        rows.append({"model": name, "mean": mean, "subsets": [calibrated_on(f[name]) for f in folds],
                     "per_fold": [v[default]["rel_l2"] <= v[l1]["rel_l2"] for v in measured],
                     "by_rel_l2": mean[default]["rel_l2"] <= mean[l1]["rel_l2"],
                     "by_task": None if mean[default]["task"] is None else
                     mean[default]["task"] >= mean[l1]["task"] - 1e-9})
    return rows


def table(rows: list[dict], runs: list[Path]) -> str:
    """The pooled verdicts as Markdown."""
    default, l1 = METHODS
    header = ("| model | output rel-L2 default / l1 | task metric default / l1 | default ≤ l1 by rel-L2, per fold "
              "(its calibration photos) | pooled: by rel-L2 | pooled: by the task metric |")
    title = f"Pooled over {len(runs)} calibration folds (the runs in {', '.join(map(str, runs))}): the mean over them."
    lines = [title, "", header, "|---|---|---|---|---|---|"]
    for r in rows:
        m = r["mean"]
        task = "-" if r["by_task"] is None else f"{m[default]['task']:.3f} / {m[l1]['task']:.3f}"
        lines.append(f"| {r['model']} | {small(m[default]['rel_l2'])} / {small(m[l1]['rel_l2'])} | {task} | "
                     f"{', '.join(f'{yes(v)} ({c})' for v, c in zip(r['per_fold'], r['subsets']))} | "
                     f"{yes(r['by_rel_l2'])} | "
                     f"{'-' if r['by_task'] is None else yes(r['by_task'])} |")
    single = ", ".join(f"{sum(r['per_fold'][i] for r in rows)} ({run})" for i, run in enumerate(runs))
    wins = sum(r["by_rel_l2"] for r in rows)
    verdict = f"The default at least as good as l1 by the pooled output rel-L2 on {wins} of {len(rows)}"
    lines += ["", f"{verdict}; by a single fold: {single}."]
    return "\n".join(lines) + "\n"


def yes(value: bool) -> str:
    return "yes" if value else "no"


def calibrated_on(row: dict) -> str:
    """The calibration subset the run that measured ``row`` was given (third_party.py's default where it was not)."""
    args = row["args"]
    return args[args.index("--calib-subset") + 1] if "--calib-subset" in args else "0:64"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="folders holding a third_party.json each, one per fold")
    parser.add_argument("--out", type=Path, help="write the table there (else print it)")
    args = parser.parse_args()
    folds = [{r["model"]: r for r in json.loads((run / "third_party.json").read_text())["rows"]} for run in args.runs]
    text = table(pooled(folds), args.runs)
    if args.out:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
