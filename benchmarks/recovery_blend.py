"""Interpolating between the pruned and the recovered weights (WiSE-FT's weight interpolation, Wortsman et al. 2022):
does a share of what `recover` trained carry further to unseen classes than all of it?

The protocol of ``recovery.py`` (``--classes k`` or ``--fold k``): `compress` (defaults) on the split's training
photos, `recover` (defaults) on the same photos with its held-out photos picking checkpoints; then for each share a
in ``--alphas`` every float weight set to start + a (recovered - start) and the model scored on the test photos and on
the held-out ones. Writes ``<out>/<name>.json`` and ``.md``.

    python benchmarks/recovery_blend.py --target 170M --classes 3 --name blend_classes3_170M
    python benchmarks/recovery_blend.py --quick       # tiny configuration, used by the test suite
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import onnx
from onnx import numpy_helper

from common import DEFAULT_DATA, compress, evaluate, original_model, recover, recover_subsets, split_flags, split_of


def blended(start: onnx.ModelProto, trained: onnx.ModelProto, share: float) -> onnx.ModelProto:
    """``trained`` with each float initializer that ``start`` has in the same shape set to start + share·(trained -
    start)."""
    before = {t.name: numpy_helper.to_array(t) for t in start.graph.initializer}
    model = onnx.ModelProto()
    model.CopyFrom(trained)
    for t in model.graph.initializer:
        w, w0 = numpy_helper.to_array(t), before.get(t.name)
        if w0 is not None and w0.shape == w.shape and w.dtype.kind == "f":
            t.CopyFrom(numpy_helper.from_array((w0 + share * (w - w0)).astype(w.dtype), t.name))
    return model


def markdown(rows: list[dict]) -> str:
    lines = ["| share of the trained change | test top-1 | test agreement | test KL | held-out top-1 | held-out KL |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        t, h = r["test"], r["held"]
        lines.append(f"| {r['alpha']:g} | {t['top1']:.1%} | {t['agreement']:.1%} | {t['kl']:.3f} | {h['top1']:.1%} "
                     f"| {h['kl']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="labelled photos (NNN_*.jpg)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_classes"))
    parser.add_argument("--target", default="170M")
    split_flags(parser)
    parser.add_argument("--alphas", default="0,0.25,0.5,0.75,1", help="comma-separated shares")
    parser.add_argument("--name", default="blend")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run: 16 calibration, 8 held-out and 10 test photos, 3 steps, shares 0 and 1")
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    args.out.mkdir(parents=True, exist_ok=True)
    train, held, test = recover_subsets(args.fold, args.classes)
    extra: list[str] = []
    if args.quick:
        train, held, test, args.target, args.alphas = "0:16", "16:24", "100:110", "245M", "0,1"
        extra = ["--steps", "3", "--distill-steps", "3"]
    original = original_model(args.out)
    pruned, recovered, scratch = (args.out / f"{args.name}_{what}.onnx" for what in ("pruned", "recovered", "blend"))
    compress(original, pruned, args.data, ["--subset", train, "--target-flops", args.target])
    report = recover(pruned, original, recovered, args.data, ["--subset", train, "--held-subset", held, *extra])
    start, trained = onnx.load(pruned), onnx.load(recovered)
    rows = []
    for alpha in (float(a) for a in args.alphas.split(",")):
        onnx.save(blended(start, trained, alpha), scratch)
        rows.append({"alpha": alpha, "test": evaluate(scratch, original, args.data, test),
                     "held": evaluate(scratch, original, args.data, held)})
        print(markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    for path in (pruned, recovered, scratch):
        path.unlink()
    result = {"split": split_of(args.fold, args.classes), "subsets": [train, held, test], "target": args.target,
              "recover": {k: report[k] for k in ("before", "after", "improved", "seconds")}, "rows": rows}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    (args.out / f"{args.name}.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
