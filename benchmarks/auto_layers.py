"""Per layer, what `--method auto` did in the fidelity runs: which groups global imitation ran on, the held
output discrepancy of the OMP and of the global choice, which won, and why global did not run elsewhere.

Reads the compress reports that `benchmarks/fidelity.py --keep-reports` kept (`<target> auto fold<k>.json`).

    python benchmarks/auto_layers.py benchmarks/results/global_auto/*/reports > benchmarks/results/global_auto/auto_layers.md
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def short(name: str) -> str:
    parts = [p for p in name.split("/") if p]
    return parts[1] if len(parts) > 1 else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", type=Path, nargs="+")
    args = parser.parse_args()
    files = sorted(f for folder in args.folders for f in folder.glob("* auto fold*.json"))
    lines = ["| run | seconds | global spent / budget s | group | kept | omp | global | winner | global s "
             "(predicted) |", "|---|---|---|---|---|---|---|---|---|"]
    ran, won, why = 0, 0, Counter()
    for f in files:
        report = json.loads(f.read_text())
        sel = report["selection"]
        head = f"{f.stem} | {report['seconds']:.0f} | {sel['spent_s']:.0f} / {sel['budget_s']:.0f}"
        for layer in report["layers"]:
            s = layer["selection"]
            if "global" not in s:
                why[s["why"].split(":")[0]] += 1
                continue
            ran += 1
            won += s["method"] == "global"
            lines.append(f"| {head} | {short(layer['group'])} | {layer['kept']}/{layer['channels']} | {s['omp']:.4f} | "
                         f"{s['global']:.4f} | {s['method']} | {s['seconds']:.0f} ({s['predicted_s']:.0f}) |")
            head = " | | "
    lines += ["", f"{len(files)} runs: global imitation ran on {ran} groups and won {won}; elsewhere omp without "
              "a global attempt: " + ", ".join(f"{n}× {reason}" for reason, n in why.most_common())]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
