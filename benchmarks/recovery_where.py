"""Where a pruned (and recovered) MobileNetV2's error sits, block by block, on its training photos, its held-out
photos and photos of classes it never saw.

For each model given (``name=path``, pruned from ``--original`` and keeping its tensor names) and each of the split's
three photo sets (``recovery.py``'s ``--classes k`` / ``--fold k`` subsets: train, held-out, test), the relative
squared error ||y - t||² / ||t - mean t||² of the model's tensor against the original's at every block end in
``--tensors``, the KL of the logits and their top-1 agreement. Writes ``<out>/<name>.json`` and ``.md``.

    onnxprune compress mobilenet_v2.onnx -o c3.onnx --calib DEV --subset '!375:500&!1%5' --target-flops 170M
    onnxprune recover c3.onnx --teacher mobilenet_v2.onnx -o r3.onnx --calib DEV --subset '!375:500&!1%5' \\
        --held-subset '!375:500&1%5'
    python benchmarks/recovery_where.py compress=c3.onnx recover=r3.onnx --classes 3 --name where_classes3_170M
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import torch

from common import DEFAULT_DATA, original_model, recover_subsets, split_flags, split_of
from onnxprune.calib.images import Preprocess, list_images, select
from onnxprune.recovery.train import evaluate_net, relative_mse, row_kl
from onnxprune.torch.engine import TorchGraph

TENSORS = ",".join([f"/features/features.{k}/Add_output_0" for k in (3, 6, 9, 12, 13, 15, 16)]
                   + ["/features/features.18/features.18.2/Clip_output_0", "/GlobalAveragePool_output_0", "logits"])
BATCH = 32


def outputs(model: onnx.ModelProto, x: np.ndarray, names: list[str]) -> list[torch.Tensor]:
    """``model``'s tensors ``names`` on the photos ``x`` (``train.evaluate_net``: in batches, without gradients)."""
    net = TorchGraph(model, outputs=names)
    return [torch.from_numpy(y).double() for y in evaluate_net(net, [x], np.arange(len(x)), BATCH)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="name=path of a model pruned from the original")
    parser.add_argument("--tensors", default=TENSORS, help="comma-separated tensor names, the last the logits")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_classes"))
    parser.add_argument("--name", default="where")
    split_flags(parser)
    args = parser.parse_args()
    names = args.tensors.split(",")
    models = {name: onnx.load(path) for name, path in (m.split("=", 1) for m in args.models)}
    original = onnx.load(original_model(args.out))
    photos = dict(zip(("train", "held-out", "test"), recover_subsets(args.fold, args.classes)))
    rows = []
    for which, subset in photos.items():
        x = np.stack([Preprocess()(p) for p in select(list_images(args.data), subset)])
        reference = outputs(original, x, names)
        for name, model in models.items():
            ys = outputs(model, x, names)
            rows.append({"model": name, "photos": which, "count": len(x),
                         "relative": [float(relative_mse([y], [t])) for y, t in zip(ys, reference)],
                         "kl": float(row_kl(ys[-1], reference[-1]).mean()),
                         "agreement": float((ys[-1].argmax(1) == reference[-1].argmax(1)).double().mean())})
    short = [n.split("/")[-2] if n.count("/") > 1 else n.rsplit("_output", 1)[0].strip("/") for n in names]
    lines = ["| model | photos | " + " | ".join(short) + " | KL | agreement |", "|---" * (len(names) + 4) + "|"]
    lines += [f"| {r['model']} | {r['photos']} ({r['count']}) | " + " | ".join(f"{v:.3f}" for v in r["relative"])
              + f" | {r['kl']:.3f} | {r['agreement']:.1%} |" for r in rows]
    result = {"split": split_of(args.fold, args.classes), "subsets": photos, "models": args.models, "tensors": names,
              "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
