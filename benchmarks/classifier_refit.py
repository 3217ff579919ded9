"""Is it the classifier's refit that `compress` fits to its photos? Its refit on pooled features (one position a
photo, what `compress` fits) against one on the features at every position before the pooling.

``recovery_where.py`` found `compress`'s logits' KL three times higher on photos of unseen classes than on its
training photos (0.47 against 1.32 at 170M, class range 3). A classifier after a global average pool sees one sample
a photo; as ``W·mean_p x_p = mean_p W·x_p``, it can be refitted on the 49 positions of each photo instead (towards the
original's logits at each position), 49 times the samples. Both refits use the library's ``refit_cv`` (ridge towards
the original's columns, chosen by two-fold cross-validation) on the split's training photos and their mirrors, and
replace the classifier of one `compress` model (default allocation) on the split's training photos; each is scored
on the split's test photos against the original. Writes ``<out>/<name>.json`` and ``.md``.

    python benchmarks/classifier_refit.py --target 170M --classes 3 --name classifier_classes3_170M
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from common import DEFAULT_DATA, original_model, recover_subsets, split_flags, split_of
from onnxprune import api
from onnxprune.calib.images import Preprocess, label_from_name, list_images, select
from onnxprune.flags.parse import parse_macs
from onnxprune.imitation.gram import ConsumerStats
from onnxprune.imitation.refit import refit_cv
from onnxprune.recovery.train import row_kl
from onnxprune.strategies import MACs
from recovery_where import outputs


def classifier(model: onnx.ModelProto) -> tuple[str, np.ndarray, np.ndarray]:
    """The global pool's input tensor and the weights (out × in) and bias of the Gemm after it."""
    pool = next(n for n in model.graph.node if n.op_type == "GlobalAveragePool")
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    values = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    weight = values[gemm.input[1]]
    trans_b = any(a.name == "transB" and a.i for a in gemm.attribute)
    return pool.input[0], weight if trans_b else weight.T, values[gemm.input[2]]


def features(model: onnx.ModelProto, pool: str, x: np.ndarray) -> np.ndarray:
    """``model``'s maps ``pool`` (its global pool's input) on the photos ``x``, (N, C, H, W) float64."""
    return outputs(model, x, [pool])[0].numpy()


def stats_of(x: np.ndarray, t: np.ndarray) -> ConsumerStats:
    """``ConsumerStats`` of the rows of ``x`` (P, D) towards ``t`` (P, O)."""
    s = ConsumerStats(x.shape[1], t.shape[1])
    s.update(x, t)
    return s


def refit(x: np.ndarray, x0: np.ndarray, w0: np.ndarray, b0: np.ndarray, cols: np.ndarray, per_position: bool
          ) -> tuple[np.ndarray, np.ndarray, float]:
    """The classifier refitted from the pruned maps ``x`` towards the original's logits (from its maps ``x0``) with
    ``refit_cv``, the folds by photo (each photo and its mirror, adjacent, in one); pooled or at every position."""
    def rows(maps: np.ndarray) -> np.ndarray:
        return maps.transpose(0, 2, 3, 1).reshape(-1, maps.shape[1]) if per_position else maps.mean((2, 3))

    fold = (np.arange(len(x)) // 2) % 2
    folds = tuple(stats_of(rows(x[fold == k]), rows(x0[fold == k]) @ w0.T + b0) for k in (0, 1))
    merged = stats_of(rows(x), rows(x0) @ w0.T + b0)
    return refit_cv(folds, np.arange(x.shape[1]), prior=w0[:, cols], merged=merged)


def scores(z: np.ndarray, z0: np.ndarray, labels: np.ndarray) -> dict:
    """Top-1, agreement with the original and KL(original || model) of the logits ``z`` (original's ``z0``)."""
    return {"top1": float(np.mean(z.argmax(1) == labels)), "agreement": float(np.mean(z.argmax(1) == z0.argmax(1))),
            "kl": float(row_kl(torch.from_numpy(z), torch.from_numpy(z0)).mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="170M")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recovery_classes"))
    parser.add_argument("--name", default="classifier")
    split_flags(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    calib, _, test = recover_subsets(args.fold, args.classes)
    path = original_model(args.out)
    pruned = api.compress(str(path), str(args.data), budget=MACs(parse_macs(args.target)), subset=calib).model
    original = onnx.load(path)
    photos = {k: select(list_images(args.data), s) for k, s in (("train", calib), ("test", test))}
    train = np.stack([Preprocess()(p, flip=f) for p in photos["train"] for f in (False, True)])
    test_x = np.stack([Preprocess()(p) for p in photos["test"]])
    labels = np.array([label_from_name(p) for p in photos["test"]])
    pool, w, b = classifier(pruned)
    pool0, w0, b0 = classifier(original)
    x, x0 = features(pruned, pool, train), features(original, pool0, train)
    # which original channel each kept one is: the one its pooled map follows most closely on the training photos
    a, o = x.mean((2, 3)), x0.mean((2, 3))
    a, o = (a - a.mean(0)) / (a.std(0) + 1e-9), (o - o.mean(0)) / (o.std(0) + 1e-9)
    cols = (a.T @ o).argmax(1)
    t, t0 = features(pruned, pool, test_x).mean((2, 3)), features(original, pool0, test_x).mean((2, 3))
    z0 = t0 @ w0.T + b0
    rows = [{"classifier": "as `compress` wrote it", "ridge": None, **scores(t @ w.T + b, z0, labels)},
            {"classifier": "the original's columns", "ridge": None, **scores(t @ w0[:, cols].T + b0, z0, labels)}]
    for per_position in (False, True):
        w, b, ridge = refit(x, x0, w0, b0, cols, per_position)
        rows.append({"classifier": "refit " + ("at every position" if per_position else "on pooled features"),
                     "ridge": ridge, **scores(t @ w.T + b, z0, labels)})
    lines = ["| classifier | ridge | top-1 | agreement | KL |", "|---|---|---|---|---|"]
    lines += [f"| {r['classifier']} | {r['ridge'] if r['ridge'] is not None else '–'} | {r['top1']:.1%} | "
              f"{r['agreement']:.1%} | {r['kl']:.3f} |" for r in rows]
    result = {"split": split_of(args.fold, args.classes), "target": args.target, "subsets": [calib, test],
              "kept": int(len(cols)), "rows": rows}
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
