"""Torch-Pruning as a peer, measured on the same work as `onnxprune compress`.

Torch-Pruning (`import torch_pruning as tp`) prunes the same torch MobileNetV2 with the same
ImageNet weights at the same MAC budgets (Conv + Gemm MACs, as `onnxprune analyze` counts them;
its global pruning ratio is bisected until the exported model lands within 1% under each budget),
with widths in multiples of 8 (`round_to=8`, like `--round-to 8`) and the classifier's output
left whole. Importances: `magnitude` (L2 group norm), `bn-scale` (|BN gamma|) and `taylor`
(|w * dL/dw| over each group, where L is the cross-entropy of the model against the ORIGINAL
model's top-1 on `--taylor-photos` evenly spaced calibration photos: label-free like onnxprune; a KL to the original's
softmax would have a zero gradient on the unpruned model). Scopes: `uniform` (one ratio per layer,
tp's default) and `global` (one importance threshold over all layers, normalised per group).

Each pruned model is exported to ONNX (input `input`, output `logits`, dynamic batch, like
artifacts/mobilenet_v2.onnx) and scored by the same `onnxprune eval --ref original` on the same
folds as benchmarks/fidelity.py (fold k calibrates on photos with index % 5 != k and evaluates
on index % 5 == k). With `--recover-targets`, the best tp variant at each of those targets (top-1,
then agreement, pooled over the folds) also gets `onnxprune recover` (default options, plus
`--recover-args`), on the photos of benchmarks/recovery.py (trained on 300, checkpoints on 100
others, scored on fold 0).
onnxprune's own rows are read, not recomputed, from the committed results (`--ours`,
`--ours-recovered`). Writes `<out>/peer.json`, `peer.md` and `peer.png`.

    python benchmarks/peer.py                      # full run: 4 budgets x 3 importances x 2 scopes
    python benchmarks/peer.py --quick              # tiny configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch_pruning as tp
from torch import nn

from common import (
    DEFAULT_DATA, RECOVER_HELD, RECOVER_TEST, RECOVER_TRAIN, evaluate, macs as count_macs, original_model, recover,
)
from fidelity import plot, pool

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's `models` package (not installed)
from models.build import INPUT_SHAPE, export_model  # noqa: E402
from models.mobilenet_v2 import mobilenet_v2  # noqa: E402
from onnxprune.calib.images import Preprocess, list_images, select  # noqa: E402
from onnxprune.flags.parse import parse_macs  # noqa: E402

IMPORTANCES = {
    "magnitude": lambda: tp.importance.GroupMagnitudeImportance(p=2),
    "bn-scale": lambda: tp.importance.BNScaleImportance(),
    "taylor": lambda: tp.importance.GroupTaylorImportance(),
}
SCOPES = {"uniform": False, "global": True}
TOLERANCE = 0.01  # a pruned model must land in [budget * (1 - TOLERANCE), budget]


@dataclass(frozen=True)
class Variant:
    importance: str
    scope: str

    @property
    def name(self) -> str:
        return f"tp {self.importance}, {self.scope}"


def conv_linear_macs(model: nn.Module) -> int:
    """Per-sample MACs of every Conv2d and Linear on a 224x224 input (onnxprune's Conv + Gemm count)."""
    total = 0

    def hook(module: nn.Module, _: tuple, out: torch.Tensor) -> None:
        nonlocal total
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            total += out[0].numel() * (module.in_channels // module.groups) * kh * kw
        else:
            total += module.in_features * module.out_features

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(torch.zeros(INPUT_SHAPE))
    for h in handles:
        h.remove()
    return total


def load_photos(data: Path, subset: str, count: int) -> torch.Tensor:
    """``count`` evenly spaced photos of ``subset`` of ``data``, preprocessed as onnxprune's image calibration."""
    paths = select(list_images(data), subset)
    paths = [paths[i] for i in np.linspace(0, len(paths) - 1, min(count, len(paths))).round().astype(int)]
    preprocess = Preprocess()
    return torch.from_numpy(np.stack([preprocess(p) for p in paths]))


def taylor_gradients(model: nn.Module, photos: torch.Tensor, batch: int = 32) -> list[torch.Tensor]:
    """Gradients of the summed cross-entropy against the model's own top-1 (= the original's: it is unpruned)."""
    model.zero_grad()
    for start in range(0, len(photos), batch):
        logits = model(photos[start:start + batch])
        nn.functional.cross_entropy(logits, logits.argmax(1).detach(), reduction="sum").backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def prune(original: nn.Module, variant: Variant, ratio: float, grads: list[torch.Tensor] | None) -> nn.Module:
    """A copy of ``original`` pruned by tp at ``ratio`` (Taylor reads ``grads``, computed on ``original``)."""
    model = copy.deepcopy(original)
    if grads is not None:
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
    pruner = tp.pruner.MetaPruner(
        model, torch.zeros(INPUT_SHAPE), importance=IMPORTANCES[variant.importance](), pruning_ratio=ratio,
        global_pruning=SCOPES[variant.scope], round_to=8, ignored_layers=[model.classifier[1]],
    )
    pruner.step()
    model.zero_grad(set_to_none=True)
    return model.eval()


def prune_to(original: nn.Module, variant: Variant, budget: int,
             grads: list[torch.Tensor] | None) -> tuple[nn.Module, float]:
    """Search tp's pruning ratio until the model's MACs land in [budget * (1 - TOLERANCE), budget].

    Where a step of the curve jumps over that window, the closest model under the budget is taken
    (and its MACs reported): with `round_to=8` and one uniform ratio, all 24-channel layers lose 8
    channels at the same ratio.

    MACs fall monotonically (in steps: widths move by 8) as the ratio grows; each probe prunes a fresh
    copy (seconds), so the bracket is narrowed by interpolating on MACs, with a bisection every
    other step so that a flat step of the curve cannot stall it.
    """
    (lo, lo_macs), (hi, hi_macs) = (0.0, conv_linear_macs(original)), (0.95, 0)
    best: tuple[nn.Module, float] | None = None
    for step in range(30):
        ratio = (lo + hi) / 2 if step % 2 else lo + (hi - lo) * (lo_macs - budget) / (lo_macs - hi_macs)
        model = prune(original, variant, ratio, grads)
        macs = conv_linear_macs(model)
        if macs <= budget:
            best, (hi, hi_macs) = (model, ratio), (ratio, macs)
            if macs >= budget * (1 - TOLERANCE):
                return best
        else:
            lo, lo_macs = ratio, macs
    if best is None:
        sys.exit(f"error: {variant.name} cannot prune to {budget / 1e6:.0f}M or under: lower the target")
    print(f"warning: {variant.name} cannot land within {TOLERANCE:.0%} under {budget / 1e6:.0f}M (its widths move "
          f"in steps of 8 channels); taking the closest under it, {conv_linear_macs(best[0]) / 1e6:.1f}M",
          file=sys.stderr)
    return best


def onnx_macs(model: Path) -> int:
    return count_macs(model)


def markdown(rows: list[dict], original: dict) -> str:
    lines = [
        "| target | pruner | fine-tuning | MACs | photos | top-1 | top-5 | agreement | KL | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| – | original | – | {original['macs'] / 1e6:.1f}M | {original['images']} | {original['top1']:.1%} "
        f"| {original['top5']:.1%} | 100% | 0 | – |",
    ]
    for r in rows:
        recovery = r["recovery"] + (f" `{' '.join(r['recover_args'])}`" if r.get("recover_args") else "")
        if r.get("improved") is False:
            recovery += ", input kept (no held-out gain)"
        lines.append(f"| {r['target']} | {r['variant']} | {recovery} | {r['macs'] / 1e6:.1f}M | {r['images']} "
                     f"| {r['top1']:.1%} | {r['top5']:.1%} | {r['agreement']:.1%} | {r['kl']:.3f} | {r['source']} |")
    return "\n".join(lines) + "\n"


def our_rows(fidelity: Path, recoveries: list[Path], targets: list[str]) -> list[dict]:
    """onnxprune's default rows from committed results: no fine-tuning (all folds) and recovered (fold 0)."""
    rows = []
    for r in json.loads(fidelity.read_text())["rows"]:
        if r["target"] in targets and r["variant"] in ("omp", "default"):
            rows.append({**r, "variant": "onnxprune default (omp)", "recovery": "none", "source": fidelity.name})
    for recovery in recoveries:
        for r in json.loads(recovery.read_text())["rows"]:
            unrecovered = r["variant"].startswith("none")
            if r["target"] in targets and (unrecovered or r["variant"] == "default"):
                rows.append({**r, "variant": "onnxprune default (omp)", "recovery": "none" if unrecovered else "recover",
                             "source": f"{recovery.name} (fold 0, {r['variant']})"})
    return rows


def best_variant(rows: list[dict], target: str) -> str:
    """The tp variant with the highest pooled top-1 (then agreement) at ``target`` without fine-tuning."""
    tp_rows = [r for r in rows if r["target"] == target and r["variant"].startswith("tp ") and r["recovery"] == "none"
               and r["source"] == "this run"]
    return max(tp_rows, key=lambda r: (r["top1"], r["agreement"]))["variant"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--targets", default="245M,170M,270M,220M",
                        help="MAC budgets, measured in this order (the recovery targets first, so a run cut short "
                             "has them); the table is sorted by budget")
    parser.add_argument("--importances", default=",".join(IMPORTANCES), help=f"among {list(IMPORTANCES)}")
    parser.add_argument("--scopes", default=",".join(SCOPES), help=f"among {list(SCOPES)}")
    parser.add_argument("--folds", type=int, default=2, help="cross-validation folds (1-5)")
    parser.add_argument("--taylor-photos", type=int, default=128,
                        help="calibration photos (evenly spaced) whose gradients feed the Taylor importance")
    parser.add_argument("--recover-targets", default="245M,170M",
                        help="targets whose best tp variant also gets `onnxprune recover` on fold 0 ('' for none)")
    parser.add_argument("--recover-args", default="",
                        help="flags added to that `onnxprune recover`, e.g. '--steps 40 --distill-steps 100' to give a "
                             "tp model (one segment: its residual streams are pruned) onnxprune's wall-time budget")
    parser.add_argument("--ours", type=Path, default=Path("benchmarks/results/fidelity.json"),
                        help="committed fidelity.py results holding onnxprune's default rows (same folds)")
    parser.add_argument("--ours-recovered", type=Path, nargs="+", metavar="FILE",
                        default=[Path("benchmarks/results/recovery.json"),
                                 Path("benchmarks/results/recovery_270M_220M.json")],
                        help="committed recovery.py results (fold 0)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run: 245M, magnitude, uniform, 16 calibration and 10 held-out photos, no recovery")
    parser.add_argument("--from-json", type=Path, metavar="FILE",
                        help="redraw peer.md/peer.png in --out from a peer.json (also one cut short), nothing rerun")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        rows = [r for r in data["rows"] if r["source"].startswith("this run")]
        targets = sorted({r["target"] for r in rows}, key=parse_macs)
        ours = our_rows(args.ours, args.ours_recovered, targets)
        print(finish(args.out, data["original"], data["folds"], ours + rows, data["complete"]))
        return
    folds = [(f"!{k}%5", f"{k}%5") for k in range(args.folds)]
    if args.quick:
        folds, args.targets, args.importances, args.scopes, args.recover_targets = (
            [("0:16", "100:110")], "245M", "magnitude", "uniform", "")
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    targets = args.targets.split(",")
    variants = [Variant(i, s) for i in args.importances.split(",") for s in args.scopes.split(",")]
    original_onnx = original_model(args.out)
    base = pool([evaluate(original_onnx, original_onnx, args.data, held) for _, held in folds])
    base["macs"] = onnx_macs(original_onnx)
    original = mobilenet_v2(pretrained=True).eval()
    if conv_linear_macs(original) != base["macs"]:
        sys.exit(f"error: the torch MobileNetV2 counts {conv_linear_macs(original)} MACs, {original_onnx} "
                 f"{base['macs']}: they must be the same model")

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        kept: dict[tuple[str, str], Path] = {}  # (target, variant name) -> fold-0 model, for recovery
        grads: dict[str, list[torch.Tensor]] = {}
        for calib, _ in folds:
            if any(v.importance == "taylor" for v in variants):
                grads[calib] = taylor_gradients(original, load_photos(args.data, calib, args.taylor_photos))
        for target in targets:
            budget = int(parse_macs(target))
            for v in variants:
                results, per_fold, macs, ratios, seconds = [], [], [], [], []
                for k, (calib, held) in enumerate(folds):
                    if v.importance != "taylor" and k > 0:  # data-free importances: one model for every fold
                        path = kept[(target, v.name)]
                    else:
                        start = time.perf_counter()
                        model, ratio = prune_to(original, v, budget, grads.get(calib) if v.importance == "taylor"
                                                else None)
                        seconds.append(time.perf_counter() - start)
                        path = Path(tmp) / f"{target}_{v.importance}_{v.scope}_fold{k}.onnx"
                        export_model(model, path)
                        macs.append(onnx_macs(path))
                        ratios.append(ratio)
                        if macs[-1] != conv_linear_macs(model):
                            sys.exit(f"error: {path.name} has {macs[-1]} MACs in onnxprune's count, "
                                     f"{conv_linear_macs(model)} in the torch count: fix conv_linear_macs")
                        if k == 0:
                            kept[(target, v.name)] = path
                    results.append(evaluate(path, original_onnx, args.data, held))
                    per_fold.append(results[-1])
                rows.append({"target": target, "variant": v.name, "importance": v.importance, "scope": v.scope,
                             "recovery": "none", "source": "this run", "macs": max(macs), "ratios": ratios,
                             "prune_seconds": float(np.mean(seconds)), "folds": per_fold, **pool(results)})
                print(markdown(rows[-1:], base).splitlines()[-1], file=sys.stderr, flush=True)
                save(args.out, base, folds, rows, complete=False)
            if target in args.recover_targets.split(","):
                rows += recover_best(rows, target, kept, original_onnx, args.data, folds[0], Path(tmp),
                                     shlex.split(args.recover_args))
                print(markdown(rows[-1:], base).splitlines()[-1], file=sys.stderr, flush=True)
                save(args.out, base, folds, rows, complete=False)

    ours = [] if args.quick else our_rows(args.ours, args.ours_recovered, targets)
    print(finish(args.out, base, folds, ours + rows, complete=True))


def finish(out: Path, base: dict, folds: list, rows: list[dict], complete: bool) -> str:
    """Write peer.json, peer.md and peer.png from ``rows`` (sorted by budget); return the table."""
    rows = sorted(rows, key=lambda r: -parse_macs(r["target"]))  # stable: within a budget, onnxprune's rows first
    save(out, base, folds, rows, complete)
    table = markdown(rows, base)
    (out / "peer.md").write_text(table)
    draw(rows, base, out / "peer.png")
    return table


def recover_best(rows: list[dict], target: str, kept: dict[tuple[str, str], Path], original: Path, data: Path,
                 fold: tuple[str, str], tmp: Path, extra: list[str]) -> list[dict]:
    """`onnxprune recover` (defaults + ``extra``) of the best tp variant at ``target``, with recovery.py's photos
    (trained on RECOVER_TRAIN, checkpoints on RECOVER_HELD, scored on fold 0): its rows before and after."""
    assert fold[1] == RECOVER_TEST, f"recovery is scored on fold 0 ({RECOVER_TEST}), not {fold[1]}"
    name = best_variant(rows, target)
    pruned, recovered, report = kept[(target, name)], tmp / "recovered.onnx", tmp / "report.json"
    start = time.perf_counter()
    rep = recover(pruned, original, recovered, data,
                  ["--subset", RECOVER_TRAIN, "--held-subset", RECOVER_HELD, *extra], report)
    wall = time.perf_counter() - start
    fold0 = next(r for r in rows if r["target"] == target and r["variant"] == name)["folds"][0]
    return [{"target": target, "variant": name, "recovery": "none", "source": "this run (fold 0)",
             "macs": onnx_macs(pruned), **fold0},
            {"target": target, "variant": name, "recovery": "recover", "source": "this run (fold 0)",
             "macs": onnx_macs(recovered), "recover_seconds": wall, "recover_args": extra,
             "held_kl": [rep["before"], rep["after"]], "improved": rep["improved"], **evaluate(recovered, original, data, RECOVER_TEST)}]


def save(out: Path, base: dict, folds: list[tuple[str, str]], rows: list[dict], complete: bool) -> None:
    """Write peer.json (also after every row, marked incomplete, so a long run leaves what it measured)."""
    (out / "peer.json").write_text(json.dumps({"original": base, "folds": folds, "complete": complete, "rows": rows},
                                              indent=2))


def draw(rows: list[dict], base: dict, path: Path) -> None:
    """tp variants and onnxprune's default vs MACs; recovered models (fold 0 only) as single markers."""
    lines: dict[str, list[dict]] = {}
    points: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: r["macs"]):
        if r["recovery"] == "recover":
            points.setdefault(f"{r['variant']} + recover (fold 0)", []).append(r)
        elif "fold 0" not in r["source"]:
            lines.setdefault(r["variant"], []).append(r)
    plot(lines, base, path, f"Torch-Pruning vs onnxprune on the real MobileNetV2, {base['images']} held-out photos "
         "(recovered: fold 0, 100 photos)", points)


if __name__ == "__main__":
    main()
