"""How much the made corpus's random-weight classifiers move under a small input perturbation: each photo plus
Gaussian noise of ``eps`` times the batch's standard deviation, through the original export alone. A model whose
decisions flip under noise far smaller than what pruning changes cannot rank two pruned copies by their agreement
with it on 50 photos; its output rel-L2 is the measure left.

    python benchmarks/corpus_sensitivity.py --data ../shared/data/imagenet-sample-dev \\
        --models pt_repvgg_like_224_static_op17,pt_resnet34_224_dynamic_op20     # made by corpus_torch.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from corpus_args import MADE  # noqa: E402
from onnxprune.calib.sources import load_calibration, preprocess_for  # noqa: E402
from onnxprune.ir.ort import make_session, model_input_specs  # noqa: E402


def _outputs(session, input_name: str, x: np.ndarray) -> np.ndarray:
    """The first output for each sample of ``x``, one run each."""
    return np.concatenate([session.run(None, {input_name: x[i:i + 1]})[0] for i in range(len(x))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True, help="photo folder")
    parser.add_argument("--models", required=True, help="comma-separated export names in the made folder (no .onnx)")
    parser.add_argument("--subset", default="100:150", help="photos (third_party.py judges on 100:150)")
    parser.add_argument("--eps", default="0.001,0.01", help="noise levels, times the inputs' standard deviation")
    args = parser.parse_args()
    print("| model | noise | output rel-L2 change | argmax kept |\n|---|---|---|---|")
    for name in args.models.split(","):
        path = MADE / f"{name}.onnx"
        session, _ = make_session(path, "cpu")
        ((input_name, shape, _),) = model_input_specs(path)
        specs = [(input_name, [1, *shape[1:]], np.dtype(np.float32))]  # one photo a run: static batch 1 or dynamic
        x = np.concatenate([b[input_name] for b in load_calibration(
            args.data, specs, preprocess=preprocess_for(specs), subset=args.subset).batches(16)])
        clean, noise = _outputs(session, input_name, x), np.random.default_rng(0).standard_normal(x.shape)
        for eps in (float(e) for e in args.eps.split(",")):
            moved = _outputs(session, input_name, x + (eps * float(x.std()) * noise).astype(np.float32))
            change = np.linalg.norm(moved - clean) / np.linalg.norm(clean)
            kept = (moved.argmax(1) == clean.argmax(1)).mean()
            print(f"| {name} | {eps:g} | {change:.4f} | {kept:.2f} ({len(x)} photos) |")


if __name__ == "__main__":
    main()
