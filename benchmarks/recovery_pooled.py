"""Recovery pooled over splits: ``recovery.py`` runs (one JSON a split) added up photo by photo, each protocol apart.

A fold of 100 photos is ± 4.5 points; pooled over splits the test photos add up, and so does the spread (``eval``'s:
the standard error of a share over the photos, sqrt(p(1 - p) / n)). Index folds (``--fold``) and class-range splits
(``--classes``) are pooled apart: their test photos differ in kind (near neighbours of the training photos, or
classes no training photo shows), and a change must win on both. Each row's gain is over the ``none`` row (`compress`
on the same training photos) of the same splits, in points of top-1 and agreement. A ``recovery_allocation.py`` run
gives two rows, its `compress` and its `recover` (with ``--late-weight 1``, `compress`'s default allocation, they are
the ``none`` and ``whole network`` rows, the default since 12-05; a ``--variant`` or ``--recover-every`` other than the
default names its `recover` row apart); the runs of one split and target are merged.

    python benchmarks/recovery_pooled.py benchmarks/results/recovery_classes/*.json \\
        --out benchmarks/results/recovery_classes/pooled.md
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

BASE = "none"  # the row every recovery's gain is measured from


def protocol(run: dict) -> str:
    """'class ranges' or 'index folds': what a run's split tests on."""
    return "class ranges" if "classes" in run.get("split", {}) else "index folds"


def as_rows(run: dict) -> dict:
    """A ``recovery_allocation.py`` run as ``recovery.py``'s (its two models as rows); another run as it is."""
    if "rows" in run:
        return run
    weight, how = run["late_weight"], _recipe(run)
    names = ("none", "whole network") if weight == 1 else (f"allocation recover ×{weight:g}: compress",
                                                          f"allocation recover ×{weight:g}: recover")
    if how:
        names = (names[0], f"{names[1]} ({how})")
    return {"split": run["split"], "rows": [
        {"target": run["target"], "variant": names[0], "seconds": None, **run["compress"]},
        {"target": run["target"], "variant": names[1], "seconds": run["recover_seconds"], **run["recover"]}]}


def _recipe(run: dict) -> str:
    """How an allocation run's `recover` differs from the default one: its variant, the share of photos it trained on
    ('' where it does not)."""
    how = [] if run.get("variant", "default") == "default" else [run["variant"]]
    if run.get("recover_every", 1) != 1:
        how.append(f"1 training photo in {run['recover_every']}")
    return ", ".join(how)


def renamed(run: dict, same: dict[str, str]) -> dict:
    """``run`` with each row whose variant is a key of ``same`` named as its value (one recipe named two ways)."""
    return {**run, "rows": [{**r, "variant": same.get(r["variant"], r["variant"])} for r in run["rows"]]}


def merged(runs: list[dict], same: dict[str, str] | None = None) -> list[dict]:
    """The runs of one split and target as one run, each (target, variant) row once (``as_rows``; ``same``:
    ``renamed``)."""
    out: dict[str, dict] = {}
    for run in (renamed(as_rows(r), same or {}) for r in runs):
        key = json.dumps([run.get("split", {}), sorted({r["target"] for r in run["rows"]})], sort_keys=True)
        if key not in out:
            out[key] = {**run, "rows": list(run["rows"])}
            continue
        into = out[key]
        into["rows"] += [r for r in run["rows"] if all((r["target"], r["variant"]) != (q["target"], q["variant"])
                                                       for q in into["rows"])]
        if "original" in run:
            into.setdefault("original", run["original"])
    return list(out.values())


def pooled(runs: list[dict], same: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """Per protocol, one row per (target, variant) present in every run of it (``merged``): the photos, the splits,
    and top-1, agreement and KL over all their test photos, with spreads, and the gain over the ``BASE`` row; the
    original's top-1 where every run has it."""
    tables: dict[str, list[dict]] = {}
    by_protocol: dict[str, list[dict]] = defaultdict(list)
    for run in merged(runs, same):
        by_protocol[protocol(run)].append(run)
    for name, group in by_protocol.items():
        keys = [(r["target"], r["variant"]) for r in group[0]["rows"]]
        keys = [k for k in keys if all(any((r["target"], r["variant"]) == k for r in run["rows"]) for run in group)]
        rows = []
        for target, variant in keys:
            picked = [next(r for r in run["rows"] if (r["target"], r["variant"]) == (target, variant))
                      for run in group]
            rows.append({"target": target, "variant": variant, **_pool(picked),
                         "splits": [run.get("split", {}) for run in group],
                         "seconds": [r["seconds"] for r in picked]})
        originals = _pool([run["original"] for run in group]) if all("original" in run for run in group) else None
        for row in rows:
            base = next((b for b in rows if b["target"] == row["target"] and b["variant"] == BASE), None)
            row["original_top1"] = None if originals is None else originals["top1"]
            if base is not None:
                row["gain_top1"] = row["top1"] - base["top1"]
                row["gain_agreement"] = row["agreement"] - base["agreement"]
        tables[name] = rows
    return tables


def _pool(rows: list[dict]) -> dict:
    """Shares over all the rows' photos (each row an ``eval`` result over its own), their spreads, the mean KL."""
    n = sum(r["images"] for r in rows)
    out: dict = {"images": n, "per_split_top1": [r["top1"] for r in rows]}
    for key in ("top1", "agreement"):
        share = sum(r[key] * r["images"] for r in rows) / n
        out[key], out[f"{key}_spread"] = share, math.sqrt(share * (1 - share) / n)
    out["kl"] = sum(r["kl"] * r["images"] for r in rows) / n
    return out


def markdown(tables: dict[str, list[dict]]) -> str:
    lines = []
    for name, rows in tables.items():
        if not rows:
            continue
        first = rows[0]
        splits = ", ".join(f"{k} {v}" for split in first["splits"] for k, v in split.items())
        original = ("" if first["original_top1"] is None
                    else f"; the original {first['original_top1']:.1%} top-1 on them")
        lines += [f"**{name}** ({splits}; {first['images']} test photos{original})", "",
                  "| target | recovery | top-1 | agreement | KL | gain (top-1 / agreement) | per split top-1 "
                  "| recover s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            gain = (f"{100 * r['gain_top1']:+.1f} / {100 * r['gain_agreement']:+.1f}" if "gain_top1" in r
                    and r["variant"] != BASE else "–")
            secs = ", ".join("–" if s is None else f"{s:.0f}" for s in r["seconds"])
            per = ", ".join(f"{t:.1%}" for t in r["per_split_top1"])
            lines.append(f"| {r['target']} | {r['variant']} | {r['top1']:.1%} ± {r['top1_spread']:.1%} "
                         f"| {r['agreement']:.1%} ± {r['agreement_spread']:.1%} | {r['kl']:.3f} | {gain} | {per} "
                         f"| {secs} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="recovery.py's and recovery_allocation.py's JSON files")
    parser.add_argument("--out", type=Path, help="also write the tables here (markdown)")
    parser.add_argument("--same", action="append", default=[], metavar="NAME=AS",
                        help="rows named NAME are the recipe named AS (e.g. 'default=whole network' for runs since "
                             "12-05, when the whole network became the default); repeatable")
    args = parser.parse_args()
    if any("=" not in pair for pair in args.same):
        parser.error(f"--same takes NAME=AS, got {[p for p in args.same if '=' not in p]}")
    same = dict(pair.split("=", 1) for pair in args.same)
    text = markdown(pooled([json.loads(p.read_text()) for p in args.runs], same))
    if args.out is not None:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
