"""Prototype (not in the product): what limits the block stage on MobileNetV2 245M? One changed segment, or a
window of them, trained as ``recover``'s block stage trains (``recovery.train.fit``: Adam, lr 1e-3, cosine over a
time, five held-out checkpoints), from the pruned model's own tensors; prints the held-out relative squared error at
the end tensor, and the training photos' own.

    python segment_proto.py ORIGINAL PRUNED --first 12 --seconds 60                   # one segment
    python segment_proto.py ORIGINAL PRUNED --first 12 --seconds 60 --views 3        # + 3 crop/flip views
    python segment_proto.py ORIGINAL PRUNED --first 11 --last 13 --seconds 150 --mode sequential   # or joint

Photos: the dev folder, training on index % 5 not in {0, 1}, held out on every other photo of index % 5 == 1 (the
half that picks ``recover``'s checkpoints). Segments are numbered as ``recovery.segments.find_segments`` cuts them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

import onnxprune
from onnxprune.ir.graph import export_model
from onnxprune.ir.load import import_graph
from onnxprune.ir.shapes import infer_shapes
from onnxprune.recovery.augment import augment_images
from onnxprune.recovery.segments import find_segments
from onnxprune.recovery.train import evaluate_net, fit
from onnxprune.runtime.segments import run_segment
from onnxprune.runtime.torch_eval import TorchGraph

DATA = Path(__file__).resolve().parents[4] / "shared/data/imagenet-sample-dev"


def photos(data: Path, teacher: onnx.ModelProto, subset: str) -> np.ndarray:
    return np.concatenate([b["input"] for b in onnxprune.calibration(data, teacher, subset=subset).batches(64)])


def rel(y: np.ndarray, t: np.ndarray) -> float:
    return float(((y - t) ** 2).sum() / ((t - t.mean(0)) ** 2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("original", type=Path)
    parser.add_argument("pruned", type=Path)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--last", type=int, help="the window's last segment (default: --first)")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--views", type=int, default=0, help="crop/flip views of every training photo added")
    parser.add_argument("--mode", choices=("joint", "sequential"), default="joint")
    parser.add_argument("--data", type=Path, default=DATA, help="the dev photos (NNN_*.jpg)")
    args = parser.parse_args()
    torch.manual_seed(0)
    teacher, student = onnx.load(args.original), onnx.load(args.pruned)
    train, held = photos(args.data, teacher, "!0,1%5"), photos(args.data, teacher, "1%5")[0::2]
    gen = torch.Generator().manual_seed(0)
    views = [np.concatenate([augment_images(torch.from_numpy(train[s : s + 32]), gen, "none").numpy()
                             for s in range(0, len(train), 32)]) for _ in range(args.views)]
    x = np.concatenate([train, *views, held])
    tr, hd, own = np.arange(len(x) - len(held)), np.arange(len(x) - len(held), len(x)), np.arange(len(train))
    s_graph, t_graph = import_graph(student), import_graph(teacher)
    segments = find_segments(s_graph, t_graph)
    s_model = infer_shapes(export_model(s_graph))
    first, last = args.first, args.first if args.last is None else args.last
    cur, _ = run_segment(gs.import_onnx(s_model), {"input": x}, segments[first].start, provider="cpu", batch_size=32)
    parts = [(first, last)] if args.mode == "joint" else [(i, i) for i in range(first, last + 1)]
    trained = [i for i in range(first, last + 1) if segments[i].trainable]
    t0 = time.time()
    for a, b in parts:
        end = segments[b].end
        net = TorchGraph(s_model, outputs=end, inputs_at=segments[a].start)
        xs = [cur[name] for name in net.input_names]
        target, _ = run_segment(t_graph, {"input": x}, end, provider="cpu", batch_size=32)
        if any(segments[i].trainable for i in range(a, b + 1)):
            params = [p for _, p in net.named_initializers() if isinstance(p, torch.nn.Parameter)]
            seconds = args.seconds * sum(segments[i].trainable for i in range(a, b + 1)) / len(trained)
            fit(net, params, xs, [target[n] for n in end], tr, hd, steps=0, lr=1e-3, batch_size=32, pull=0.0, seed=0,
                seconds=seconds, evals=5)
        cur = dict(zip(end, evaluate_net(net, xs, np.arange(len(x)), 32)))
    y, t = cur[end[0]], target[end[0]]
    print(f"{args.mode} {first}..{last} -> {end[0]}, {args.views} views: held-out {rel(y[hd], t[hd]):.4f}, "
          f"training photos {rel(y[own], t[own]):.4f} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
