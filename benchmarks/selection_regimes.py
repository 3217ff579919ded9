"""Channel selection where the calibration samples are few for the refit: OMP against regularised variants of it and
against a judgement of OMP and L1 on the network's output (notebook, "Selection where the refit needs a large
ridge").

Each variant is a ``Selector`` passed to ``compress`` in place of the one its flags name (the flags otherwise as
``onnxprune compress`` reads them: a classifier calibrates on each photo and its mirror), then the written model is
judged against the original by ``onnxprune eval`` on other photos:

    python benchmarks/selection_regimes.py \\
        benchmarks/results/third_party_models/made/pt_repvgg_like_224_dynamic_op13.onnx --variants omp,l1,judged
    python benchmarks/selection_regimes.py mobilenet_v2.onnx --flags "--target-flops 170M" \\
        --calib-subset '!0%5' --eval-subset 0%5 --variants omp,judged-gate1

Variants: ``omp`` (the default), ``l1``, ``random<seed>``, ``omp-ridge<r>`` (OMP's least squares with ridge r towards 0
instead of 1e-4), ``omp-cv`` (that ridge cross-validated on every column), ``omp-prior`` (OMP rerun with the refit's
cross-validated ridge on its first choice, towards the consumer's weights: the constrained MAP of the refit;
``omp-prior-full``: the ridge cross-validated on every column; ``omp-prior-gate<r>``: only where that ridge is at
least r, else OMP's choice), ``judged`` (OMP and L1 each refitted as ``Refit``
writes them, the lower discrepancy of the network's output on 64 held calibration samples kept), ``judged-gate<r>``
(judged only where the refit's cross-validated ridge on OMP's choice is at least r), ``judged-held<n>`` (on n held
samples), ``judged-sig<level>`` (L1's choice only where at least ``level`` of the held samples' bootstrap resamples
favour it, 0.95 by default), ``cv-pick`` (of OMP's and OMP-prior's choices the one whose refit has the lower
cross-validated loss; ``cv-pick:omp+omp-prior+l1`` names the candidates).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from common import DEFAULT_DATA, evaluate

from onnxprune.cli import flag_values
from onnxprune.flags.jobs import compress_job
from onnxprune.imitation import omp, refit
from onnxprune.imitation.refit import expand_channels as expand
from onnxprune.imitation.refit import refit_cv
from onnxprune.strategies import L1, OMP, Random
from onnxprune.strategies.base import Selector
from onnxprune.strategies.global_search import Search
from onnxprune.tasks.base import log_probs


def _refit_ridge(d, keep: np.ndarray) -> float:
    """The ridge the refit's cross-validation picks for consumer ``d`` on channels ``keep`` (towards its weights)."""
    cols = expand(keep, d.current.k)
    return refit_cv(d.folds, cols, prior=d.current.weight[:, cols], merged=d.stats)[2]


def _relative(path: omp.OmpPath, width: int) -> float:
    return float(path.curve[width] / max(path.curve[0], np.finfo(float).tiny))


@dataclass(frozen=True)
class OmpRidge(Selector):
    """OMP with ridge ``ridge`` (relative to the trace, towards 0) in its least squares."""

    ridge: float

    def select(self, ctx, group, data, width):
        path = omp.stats_omp([d.stats for d in data], [d.current.k for d in data], width, ridge=self.ridge,
                             work=omp.SELECT_WORK)
        return path.support(width), np.ones(width), _relative(path, width)


@dataclass(frozen=True)
class OmpCv(Selector):
    """OMP with ridge towards 0 chosen by the refit's cross-validation on every column (the largest over consumers)."""

    def select(self, ctx, group, data, width):
        ridge = max(refit_cv(d.folds, np.arange(d.stats.d), prior=None)[2] for d in data)
        return OmpRidge(ridge).select(ctx, group, data, width)


@dataclass(frozen=True)
class OmpPrior(Selector):
    """OMP on the refit's objective, min ||W x_S - t||² + λ||W - W0||² with W's dropped columns 0, i.e. OMP on
    (A + λI, B + λW0ᵀ), at the ridge the refit's cross-validation picks on OMP's first choice (``full``: on every
    column); OMP's own choice where that ridge is below ``gate`` on every consumer."""

    full: bool = False
    gate: float = 0.0

    def select(self, ctx, group, data, width):
        own = OMP().select(ctx, group, data, width)
        first = np.arange(group.channels) if self.full else own[0]
        ridges = [_refit_ridge(d, first) for d in data]
        ctx.note(group, {"method": "omp" if max(ridges) < self.gate else "omp-prior", "ridge": max(ridges)})
        if max(ridges) < self.gate:
            return own
        a_s, b_s, e_s = [], [], []
        for d, ridge in zip(data, ridges):
            s, w0 = d.stats, np.asarray(d.current.weight, np.float64)
            cols = expand(first, d.current.k)
            lam = ridge * np.trace(s.xx[np.ix_(cols, cols)]) / (len(cols) * s.count)  # the refit's units
            a, b, e = omp.centred(s.xx, s.xt, s.sx, s.st, s.tt, s.count)
            a[np.diag_indices(s.d)] += lam
            a_s.append(a)
            b_s.append(b + lam * w0.T)
            e_s.append(e + lam * float(np.sum(w0**2)))
        ks = [d.current.k for d in data]
        per_step = max(1, math.ceil(omp.path_work(ks, [d.stats.d for d in data], width) / omp.SELECT_WORK))
        path = omp._path(omp.GroupOmp(a_s, b_s, e_s, ks, width, ridge=0.0, own=True), width, per_step)
        return path.support(width), np.ones(width), _relative(path, width)


@dataclass(frozen=True)
class Judged(Selector):
    """OMP and L1 refitted as ``Refit`` writes them, the lower output discrepancy on ``held`` held samples kept;
    only where the refit's cross-validated ridge on OMP's choice is at least ``gate``."""

    gate: float = 0.0
    held: int = 64

    def select(self, ctx, group, data, width):
        own = OMP().select(ctx, group, data, width)
        ridge = max(_refit_ridge(d, own[0]) for d in data) if self.gate > 0 else None
        other = L1().select(ctx, group, data, width)
        if (ridge is not None and ridge < self.gate) or np.array_equal(other[0], own[0]):
            return own
        d_own, d_l1 = Search(ctx, group, data, self.held).judge([own[0], other[0]])
        ctx.note(group, {"method": "l1" if d_l1 < d_own else "omp", "omp": float(d_own), "l1": float(d_l1),
                         "ridge": ridge})
        return other if d_l1 < d_own else own


def _cv_loss(data, keep: np.ndarray) -> float:
    """The refit's two-fold cross-validated loss on channels ``keep`` at its chosen ridge, summed over consumers."""
    total = 0.0
    for d in data:
        cols = expand(keep, d.current.k)
        a, b = d.folds
        judges = [refit._held_out(f, h, cols, d.current.weight[:, cols], refit.RIDGE_GRID) for f, h in ((a, b), (b, a))]
        i = refit._descend(lambda i, judges=judges: sum(j(i) for j in judges), len(refit.RIDGE_GRID))
        total += sum(j(i) for j in judges)
    return total


@dataclass(frozen=True)
class CvPick(Selector):
    """Of OMP's, OMP-prior's (and L1's) choices, the one whose refit has the lowest cross-validated loss."""

    names: tuple[str, ...] = ("omp", "omp-prior")

    def select(self, ctx, group, data, width):
        picks = {n: variant(n).select(ctx, group, data, width) for n in self.names}
        losses = {n: _cv_loss(data, np.sort(p[0])) for n, p in picks.items()}
        best = min(losses, key=losses.get)
        ctx.note(group, {"method": best, **{n: float(v) for n, v in losses.items()}})
        return picks[best]


def _per_sample(reference: dict, outputs: list[dict]) -> np.ndarray:
    """``raw_discrepancy``'s terms sample by sample (they sum to it): KL rows of logits, else squared errors over the
    reference's whole energy."""
    out = {k: np.concatenate([o[k] for o in outputs])[: len(v)] for k, v in reference.items()}
    total = 0.0
    for name, ref in reference.items():
        ref, y = ref.astype(np.float64), out[name].astype(np.float64)
        if ref.ndim == 2 and ref.shape[1] > 1:
            log_p, log_q = log_probs(ref), log_probs(y)
            total = total + np.sum(np.exp(log_p) * (log_p - log_q), axis=1)
        else:
            err = np.square(y - ref).reshape(len(ref), -1).sum(axis=1)
            total = total + err / max(float(np.sum(np.square(ref))), 1e-30)
    return total


@dataclass(frozen=True)
class JudgedSig(Selector):
    """L1's choice in place of OMP's only where the network's output on the held samples is lower with it on at
    least ``level`` of their bootstrap resamples (paired)."""

    level: float = 0.95
    held: int = 64

    def select(self, ctx, group, data, width):
        own, other = OMP().select(ctx, group, data, width), L1().select(ctx, group, data, width)
        if np.array_equal(other[0], own[0]):
            return own
        search = Search(ctx, group, data, self.held)
        values, reference = search.downstream.samples(search.held)
        n = len(next(iter(reference.values())))
        per = [_per_sample(reference, search.downstream.run(search.linears(k, cross_validated=True), values, n))
               for k in (own[0], other[0])]
        gen = np.random.default_rng(0)
        picks = gen.integers(0, n, (1000, n))
        share = float(np.mean(per[1][picks].sum(axis=1) < per[0][picks].sum(axis=1)))
        ctx.note(group, {"method": "l1" if share >= self.level else "omp", "omp": float(per[0].sum()),
                         "l1": float(per[1].sum()), "share": share})
        return other if share >= self.level else own


def variant(name: str) -> Selector:
    """The selector a variant's name asks for."""
    if name == "omp":
        return OMP()
    if name == "l1":
        return L1()
    if name in ("omp-prior", "omp-prior-full"):
        return OmpPrior(full=name.endswith("full"))
    if name == "omp-cv":
        return OmpCv()
    if name.startswith("cv-pick"):
        names = name[len("cv-pick:"):]
        return CvPick(tuple(names.split("+"))) if names else CvPick()
    if name.startswith("judged-sig"):
        return JudgedSig(float(name[len("judged-sig"):] or 0.95))
    if name == "judged":
        return Judged()
    for prefix, make in (("random", lambda v: Random(int(v))), ("omp-ridge", lambda v: OmpRidge(float(v))),
                         ("judged-gate", lambda v: Judged(gate=float(v))),
                         ("omp-prior-gate", lambda v: OmpPrior(gate=float(v))),
                         ("judged-held", lambda v: Judged(held=int(v)))):
        if name.startswith(prefix) and name != prefix:
            return make(name[len(prefix):])
    raise SystemExit(f"unknown variant {name!r}: see this script's docstring")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--calib-subset", default="0:64")
    parser.add_argument("--eval-subset", default="100:150")
    parser.add_argument("--flags", default="--target-ratio 0.85", help="compress's budget and other flags")
    parser.add_argument("--variants", default="omp,l1,judged")
    parser.add_argument("--out", type=Path, default=Path("/tmp/selection_regimes"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.variants.split(","):
        out = args.out / f"{args.model.stem}_{name}.onnx"
        values = flag_values("compress", [str(args.model), "-o", str(out), "--calib", str(args.data), "--subset",
                                          args.calib_subset, *shlex.split(args.flags)])
        job = compress_job(values)
        job.options["select"] = variant(name)
        t0 = time.perf_counter()
        result = job.run()
        seconds = time.perf_counter() - t0
        result.save(out, refuse=[args.model])
        judged = [layer.selection for layer in result.report.layers if layer.selection]
        scores = evaluate(out, args.model, args.data, args.eval_subset)
        row = {"variant": name, "rel_l2": scores["rel_l2"], "agreement": scores["agreement"], "kl": scores["kl"],
               "metrics": scores["metrics"], "seconds": seconds, "notes": judged}
        print(json.dumps(row), flush=True)
        rows.append(row)
    (args.out / f"{args.model.stem}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
