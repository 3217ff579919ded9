"""Exploration for issue 18: widths allocated by the network's output instead of per-layer losses.

For each fold, every prunable group of the real MobileNetV2 is pruned ALONE (default selection and refit,
calibrated on the 100 photos ``k+1 % 5``) to 25/50/75% of its channels, and the KL of the network's output
against the original is measured on the 100 photos ``k+2 % 5`` (both inside the fold's calibration set).
A greedy then narrows, step by step, the group whose next candidate width costs the least added KL per MAC
saved, until the budget is met (sensitivities summed as if independent). The model is then compressed with
those widths on the fold's 400 calibration photos and scored on the held-out 100, like benchmarks/fidelity.py.

    python benchmarks/e2e_allocation.py --targets 220M,170M --out benchmarks/results/e2e_allocation
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

import onnxprune
from common import DEFAULT_DATA, original_model
from fidelity import markdown, pool
from onnxprune.flags.parse import parse_macs
from onnxprune.strategies import Allocator, MACs, Ratio

RATIOS = (0.75, 0.5, 0.25)


@dataclass(frozen=True)
class Fixed(Allocator):
    """Widths given in advance (groups not listed stay whole)."""

    given: dict = field(default_factory=dict)
    needs_curves = False

    def widths(self, cost, groups, curves, target, min_channels, round_to):
        return {g.id: self.given.get(g.id, g.channels) for g in groups}


def logits(model, arrays: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return np.concatenate([session.run(None, {name: arrays[i : i + 50]})[0] for i in range(0, len(arrays), 50)])


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean KL(softmax p || softmax q) over samples."""
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=1, keepdims=True)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1)))


def candidates(channels: int) -> list[int]:
    return sorted({max(8, int(round(r * channels / 8)) * 8) for r in RATIOS} - {channels}, reverse=True)


def sensitivities(model, data: Path, k: int) -> tuple[dict, dict]:
    """{group id: {width: KL}} of each group pruned alone, and the groups by id."""
    calib = onnxprune.calibration(str(data), model, subset=f"{(k + 1) % 5}%5")
    probe_set = onnxprune.calibration(str(data), model, subset=f"{(k + 2) % 5}%5")
    probe = np.concatenate([b[next(iter(b))] for b in probe_set.batches(50)])
    reference = logits(model, probe)
    analysis = onnxprune.analyze(model)
    groups = {g.id: g for g in analysis.groups if g.prunable}
    table: dict[int, dict[int, float]] = {}
    for gid, g in groups.items():
        table[gid] = {}
        for w in candidates(g.channels):
            try:
                r = onnxprune.compress(model, calib, budget=Ratio(0.999), allocate=Fixed({gid: w}))
            except onnxprune.OnnxPruneError as e:  # a group the schedule leaves alone (residual, SE)
                print(f"  {g.name}: {e}", flush=True)
                break
            if not r.report.layers:
                break
            table[gid][w] = kl(reference, logits(r.model, probe))
        print(f"  {g.name} ({g.channels}): {table[gid]}", flush=True)
    return table, groups


def allocate(model, table: dict, groups: dict, target: float) -> dict[int, int]:
    """Greedy: narrow the group whose next width adds the least KL per MAC saved, until ``target``."""
    macs = onnxprune.analyze(model).macs
    widths = {gid: g.channels for gid, g in groups.items()}
    added = {gid: 0.0 for gid in groups}  # each group's KL at its current width
    while (current_macs := macs.macs(widths)) > target:
        best = None
        for gid, row in table.items():
            narrower = [w for w in row if w < widths[gid]]
            if not narrower:
                continue
            w = max(narrower)
            saved = current_macs - macs.macs({**widths, gid: w})
            price = (row[w] - added[gid]) / max(saved, 1.0)
            if best is None or price < best[0]:
                best = (price, gid, w)
        if best is None:
            raise SystemExit(f"target {target:.0f} unreachable with these candidate widths")
        _, gid, w = best
        widths[gid], added[gid] = w, table[gid][w]
    return widths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--targets", default="220M,170M")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    model = onnxprune.load(original)
    results: dict[str, list] = {t: [] for t in args.targets.split(",")}
    log = {}
    for k in range(2):
        t0 = time.perf_counter()
        table, groups = sensitivities(model, args.data, k)
        probe_seconds = time.perf_counter() - t0
        calib = onnxprune.calibration(str(args.data), model, subset=f"!{k}%5")
        for target in results:
            widths = allocate(model, table, groups, parse_macs(target))
            t1 = time.perf_counter()
            r = onnxprune.compress(model, calib, budget=MACs(parse_macs(target)), allocate=Fixed(widths))
            seconds = time.perf_counter() - t1
            score = onnxprune.evaluate(r.model, args.data, original, subset=f"{k}%5").to_dict()
            results[target].append({**score, "macs": r.report.macs_after, "seconds": seconds})
            log[f"fold{k}_{target}"] = {"widths": {groups[g].name: w for g, w in widths.items()},
                                        "probe_seconds": probe_seconds, "compress_seconds": seconds,
                                        "sensitivity": {groups[g].name: row for g, row in table.items()}}
            print(target, k, results[target][-1], flush=True)
    rows = [{"target": t, "variant": "end-to-end widths", "macs": folds[0]["macs"],
             "compress_seconds": sum(f["seconds"] for f in folds) / len(folds), **pool(folds)}
            for t, folds in results.items()]
    reference = pool([onnxprune.evaluate(model, args.data, original, subset=f"{k}%5").to_dict() for k in range(2)])
    reference["macs"] = onnxprune.analyze(model).macs.total
    (args.out / "e2e_allocation.json").write_text(json.dumps({"original": reference, "rows": rows, "log": log},
                                                             indent=1))
    (args.out / "e2e_allocation.md").write_text(markdown(rows, reference))
    print(markdown(rows, reference))


if __name__ == "__main__":
    main()
