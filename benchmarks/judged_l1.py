"""A prototype, not in the product: per group, OMP's or L1's channels, whichever gives the lower discrepancy of the
network's output on held calibration samples (each refitted as ``Refit`` writes it; ``Auto``'s judge), to test
whether that choice closes the two trained losses to ``--method l1`` of the corpus (issue 37).

    python benchmarks/judged_l1.py MODEL IMAGES OUT.onnx [--input-shape S] [--task T] [--soft]
    onnxprune eval OUT.onnx --images IMAGES --subset 64:150 --ref MODEL [--input-shape S] [--task T] --json

IMAGES: for the text models, the pages or tables ``text_images.write_text_images(folder, kind, 150)`` writes (as
``third_party.py`` does). Calibration: images ``0:64``, ``--target-ratio 0.85``, the defaults otherwise. ``--soft`` scores the judge on
the output soft-binarised at a text detector's threshold, σ((p − 0.3) / 0.05), instead of the raw objective.
Prints each judged group's discrepancy with OMP's and with L1's channels (groups where both keep the same
channels are not judged).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import numpy as np
import onnx

import onnxprune
import onnxprune.strategies.downstream as downstream
from onnxprune.strategies import Ratio
from onnxprune.strategies.base import Selector
from onnxprune.strategies.global_search import Search
from onnxprune.strategies.selectors import L1, OMP


@dataclass(frozen=True)
class Judged(Selector):
    """OMP's or L1's channels, the lower output discrepancy on at most ``held`` held samples."""

    held: int = 128
    log: list = field(default_factory=list, compare=False)

    def select(self, ctx, group, data, width):
        omp, l1 = OMP().select(ctx, group, data, width), L1().select(ctx, group, data, width)
        if np.array_equal(omp[0], l1[0]):
            return omp
        d_omp, d_l1 = Search(ctx, group, data, self.held).judge([omp[0], l1[0]])
        self.log.append({"group": group.name, "omp": float(d_omp), "l1": float(d_l1)})
        return omp if d_omp <= d_l1 else (l1[0], np.ones(width), None)


def soft_discrepancy(reference, outputs) -> float:
    """The squared error of the outputs soft-binarised at 0.3 over the reference's energy."""
    err = energy = 0.0
    for ref_chunk, out_chunk in zip(reference, outputs, strict=True):
        for name, ref in ref_chunk.items():
            b_ref, b_out = (1 / (1 + np.exp(-(np.asarray(a, np.float64) - 0.3) / 0.05)) for a in (ref, out_chunk[name]))
            err += float(np.sum(np.square(b_out - b_ref)))
            energy += float(np.sum(np.square(b_ref)))
    return err / max(energy, 1e-30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("images")
    parser.add_argument("out")
    parser.add_argument("--input-shape")
    parser.add_argument("--task", default="auto")
    parser.add_argument("--soft", action="store_true")
    a = parser.parse_args()
    if a.soft:
        downstream.raw_discrepancy = soft_discrepancy  # what ConsumerDownstream.losses scores by
    shape = [a.input_shape] if a.input_shape else None
    judged = Judged()
    result = onnxprune.compress(a.model, a.images, subset="0:64", budget=Ratio(0.85), select=judged,
                                input_shape=shape, task=a.task,
                                preprocess=onnxprune.preprocess_for(a.model, input_shape=shape))
    onnx.save(result.model, a.out)
    print(json.dumps(judged.log, indent=1))


if __name__ == "__main__":
    main()
