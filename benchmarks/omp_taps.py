"""A prototype, not in the product: the group OMP on fewer columns a channel (issue 37, point 6).

A 3×3 consumer gives each channel 9 columns, and the OMP's work grows with k² to k³ per channel. Here each channel's
columns are projected on the ``--keep`` directions that explain most of the consumer's target by themselves (the
leading eigenvectors of (W_iᵀB_i)(W_iᵀB_i)ᵀ, W_i whitening the channel's block of A + λI), and the path on them is
compared with the exact one: for each consumer, the relative loss of the least-squares refit (ridge 1e-3) on the
first quarter, half and three quarters of each path's channels, and the share of channels the two paths share.

    python benchmarks/omp_taps.py                         # YOLOv8n (nudenet 320n) at 320, 32 dev photos
    python benchmarks/omp_taps.py --keep 1,2,3,4,6

The product does not reduce taps: end to end it cost fidelity (the notebook's "A cheaper OMP that costs fidelity").
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

import onnxprune
from common import DEFAULT_DATA
from detectors import _preprocess
from onnxprune.analysis import consumers
from onnxprune.calib.images import list_images
from onnxprune.imitation.omp import RIDGE, GroupOmp, _path, centred
from onnxprune.imitation.refit import centred_energy, expand_channels, quadratic_loss_full, refit_full
from onnxprune.imitation.gram import ConsumerStats
from onnxprune.ir.load import import_graph
from onnxprune.ir.probe import run_each
from third_party import wheel_file

NODES = "/model.7/conv/Conv,/model.8/m.0/cv2/conv/Conv,/model.19/conv/Conv,/model.6/m.0/cv2/conv/Conv"


def reduced(a: np.ndarray, b: np.ndarray, k: int, r: int, lam: float) -> tuple[np.ndarray, np.ndarray]:
    """(P A Pᵀ, P B): each channel's k columns projected on its r leading directions (see the module docstring)."""
    n = len(a) // k
    p = np.zeros((n * r, len(a)))
    for i in range(n):
        s = slice(i * k, (i + 1) * k)
        inv = np.linalg.inv(np.linalg.cholesky(a[s, s] + lam * np.eye(k)))
        _, u = np.linalg.eigh(inv @ b[s] @ b[s].T @ inv.T)
        p[i * r:(i + 1) * r, s] = (inv.T @ u[:, ::-1][:, :r]).T
    return p @ a @ p.T, p @ b


def consumer_stats(model: Path, shape: str, nodes: list[str], images: list[Path]) -> dict[str, tuple]:
    """Each consumer's statistics on ``images``: its input unfolded, its own output the target."""
    loaded = onnxprune.load(model, [shape])
    pre = _preprocess(loaded, ["--input-shape", shape, "--mean", "0,0,0", "--std", "1,1,1"])
    graph = {n.name: n for n in import_graph(loaded).nodes}
    names = [graph[n].inputs[0].name for n in nodes]
    feed = loaded.graph.input[0].name
    runs = run_each(loaded, names, [{feed: pre(p)[None]} for p in images])
    out = {}
    for node_name, name in zip(nodes, names):
        node, lin = graph[node_name], consumers.matrix(graph[node_name])
        stats = ConsumerStats(lin.weight.shape[1], lin.weight.shape[0])
        w, bias = torch.from_numpy(lin.weight.astype(np.float32)), torch.from_numpy(lin.bias.astype(np.float32))
        for r in runs:
            x = consumers.unfold(node, torch.from_numpy(r[name]))
            stats.update(x, torch.matmul(w, x) + bias[:, None])
        out[node_name] = (stats, lin.k)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--nodes", default=NODES, help="3×3 consumers of nudenet's YOLOv8n")
    parser.add_argument("--keep", default="2,4,6", help="directions kept of each channel's 9 columns")
    a = parser.parse_args()
    model = wheel_file("nudenet", "320n.onnx")
    if model is None:
        sys.exit("nudenet is not installed")
    data = consumer_stats(model, "1x3x320x320", a.nodes.split(","), list_images(a.data)[: a.images])
    for name, (stats, k) in data.items():
        aa, bb, e = centred(stats.xx, stats.xt, stats.sx, stats.st, stats.tt, stats.count)
        n = len(aa) // k
        widths = [n // 4, n // 2, 3 * n // 4]
        energy = centred_energy(stats)

        def loss(order: np.ndarray, w: int) -> float:
            cols = expand_channels(np.sort(order[:w]), k)
            return quadratic_loss_full(stats, cols, *refit_full(stats, cols, 1e-3)) / energy

        exact = _path(GroupOmp([aa], [bb], [e], [k], widths[-1], ridge=RIDGE), widths[-1])
        print(f"{name} ({n} channels, k {k}): exact " + " ".join(f"{loss(exact.order, w):.4f}" for w in widths))
        for r in map(int, a.keep.split(",")):
            ar, br = reduced(aa, bb, k, r, RIDGE * np.trace(aa) / len(aa))
            path = _path(GroupOmp([ar], [br], [e], [r], widths[-1], ridge=RIDGE), widths[-1])
            shared = [len(set(exact.order[:w]) & set(path.order[:w])) / w for w in widths]
            print(f"  {r} of {k}: " + " ".join(f"{loss(path.order, w):.4f}" for w in widths)
                  + "  shared " + " ".join(f"{s:.2f}" for s in shared))


if __name__ == "__main__":
    main()
