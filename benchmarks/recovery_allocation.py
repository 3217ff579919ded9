"""Does `recover` carry further to unseen classes when `compress` prunes the last blocks less and the first ones more?

Where the error of a pruned and recovered MobileNetV2 sits (``recovery_where.py``): `recover` lowers the first blocks'
error on photos of unseen classes as much as on its training photos, and the last blocks' (7x7 maps, 49 positions
a photo for most of the weights) on its training photos only. If so, an allocation that moves the pruning from the
last blocks to the first ones moves error from where `recover` cannot mend it for new photos to where it can.
`compress --allocation recover` (``strategies.Recoverable``): the output allocation (the default) with the probed
discrepancy of the last ``--late-share`` of the groups (in the network's order) multiplied by ``--late-weight``, so
the greedy narrows them less and the others more to meet the same MACs.

``recovery.py``'s protocol (``--classes k`` or ``--fold k``): `compress` on the split's training photos (through
the API, the allocator above), `recover` (defaults) on the same photos with the held-out ones choosing checkpoints,
both scored on the split's test photos against the original (``--variant``: `recover` with the flags of one of
``recovery.py``'s variants instead; ``--recover-every k``: `recover` on the training photos whose index is a multiple
of k). Writes ``<out>/<name>.json`` (with what each stage of `recover` did) and ``.md``.

    python benchmarks/recovery_allocation.py --target 170M --classes 3 --late-weight 3 --name late3_classes3_170M
    python benchmarks/recovery_allocation.py --target 170M --fold 0 --late-weight 3 --name late3_fold0_170M
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import (
    DEFAULT_DATA, evaluate, every_flag, original_model, recover, recover_subsets, split_flags, split_of, thinned,
)
from onnxprune import api
from onnxprune.flags.parse import parse_macs
from onnxprune.strategies import MACs, Recoverable
from recovery import VARIANTS, stages, verdicts

KEYS = ("top1", "agreement", "kl")


def row(name: str, scores: dict) -> str:
    return f"| {name} | " + " | ".join(f"{scores[k]:.1%}" if k != "kl" else f"{scores[k]:.3f}" for k in KEYS) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="170M")
    parser.add_argument("--late-weight", type=float, default=3.0)
    parser.add_argument("--late-share", type=float, default=1 / 3)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_classes"))
    parser.add_argument("--name", default="allocation")
    parser.add_argument("--variant", default="default", choices=list(VARIANTS), help="`recover`'s flags")
    parser.add_argument("--keep", action="store_true", help="keep the pruned and recovered models (<name>_*.onnx)")
    split_flags(parser)
    every_flag(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calib, held, test = recover_subsets(args.fold, args.classes)
    original = original_model(args.out)
    pruned, recovered = args.out / f"{args.name}_compressed.onnx", args.out / f"{args.name}_recovered.onnx"
    allocator = Recoverable(late_share=args.late_share, late_weight=args.late_weight)
    result = api.compress(str(original), str(args.data), budget=MACs(parse_macs(args.target)), allocate=allocator,
                          subset=calib)
    result.save(pruned, refuse=[original])
    report = result.to_dict()
    widths = {layer["group"]: [layer["channels"], layer["kept"]] for layer in report["layers"]}
    compressed = evaluate(pruned, original, args.data, test)
    rep = recover(pruned, original, recovered, args.data,
                  ["--subset", thinned(calib, args.recover_every), "--held-subset", held, *VARIANTS[args.variant]])
    after = evaluate(recovered, original, args.data, test) if rep["improved"] else compressed
    for path in () if args.keep else (pruned, recovered):
        path.unlink(missing_ok=True)
    out = {"split": split_of(args.fold, args.classes), "subsets": [calib, held, test], "target": args.target,
           "original": evaluate(original, original, args.data, test), "late_share": args.late_share,
           "late_weight": args.late_weight, "variant": args.variant, "macs": report["macs_after"],
           "widths": widths, "compress": compressed, "recover": after, **verdicts(rep),
           "improved": rep["improved"], "recover_seconds": rep["seconds"], "recover_every": args.recover_every,
           "recover_samples": rep["samples_given"], "confidence": rep["confidence"], "stages": stages(rep)}
    (args.out / f"{args.name}.json").write_text(json.dumps(out, indent=1))
    table = "\n".join(["| model | top-1 | agreement | KL |", "|---|---|---|---|",
                       row("`compress`", compressed), row("then `recover`", after)]) + "\n"
    (args.out / f"{args.name}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
