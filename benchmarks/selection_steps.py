"""What taking several channels a step costs the OMP selection: runs ``onnxprune compress`` (the arguments after
``--``) with the selector's path exact, keeps the statistics of every selection whose exact path would pass
``--min-work`` multiply-adds (``omp.path_work``), and replays each path at the step sizes given, printing the
selection's own objective (the refitted consumers' relative error at the allocated width), how many chosen channels
differ from those of the first step size given (1: the exact path), and the seconds.

    python benchmarks/selection_steps.py --steps 1,3,4 -- \\
        benchmarks/results/third_party_models/made/pt_resnet34_224_dynamic_op20.onnx -o /tmp/r34.onnx \\
        --calib ../shared/data/imagenet-sample-dev --subset 0:32 --target-ratio 0.85
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import onnxprune.strategies.selectors as selectors
from onnxprune.cli import main as cli_main
from onnxprune.imitation.omp import _path, path_work, stats_omp_state
from onnxprune.imitation.gram import ConsumerStats


def captured(cli_args: list[str], min_work: float) -> list[tuple[list[ConsumerStats], list[int], int]]:
    """(statistics, columns per channel, width) of each selection over ``min_work``, from one exact compress."""
    seen = []
    exact = selectors.stats_omp

    def keep(stats: list[ConsumerStats], ks: list[int], width: int, ridge: float | None = None,
             work: float = np.inf) -> object:
        if path_work(ks, [s.d for s in stats], width) > min_work:
            seen.append((stats, ks, width))
        return exact(stats, ks, width) if ridge is None else exact(stats, ks, width, ridge)

    selectors.stats_omp = keep
    sys.argv = ["onnxprune", "compress", *cli_args]
    try:
        cli_main()
    except SystemExit as done:
        if done.code:
            raise
    finally:
        selectors.stats_omp = exact
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="1,3,4", help="channels a step to replay (1: exact)")
    parser.add_argument("--min-work", type=float, default=1e9, help="selections whose exact path passes this")
    parser.add_argument("compress", nargs=argparse.REMAINDER, help="-- then the compress arguments")
    args = parser.parse_args()
    cli_args = args.compress[1:] if args.compress[:1] == ["--"] else args.compress
    print("| consumers' columns | width | path work | channels a step | relative error | channels differing | s |")
    print("|---|---|---|---|---|---|---|")
    for stats, ks, width in captured(cli_args, args.min_work):
        exact = None
        for m in (int(s) for s in args.steps.split(",")):
            state = stats_omp_state(stats, ks, width)
            start = state.loss
            t0 = time.perf_counter()
            path = _path(state, width, m)
            seconds = time.perf_counter() - t0
            keep = path.support(width)
            exact = keep if exact is None else exact
            print(f"| {[s.d for s in stats]} | {width} | {path_work(ks, [s.d for s in stats], width):.2g} | {m} | "
                  f"{path.curve[width] / start:.5f} | {len(np.setdiff1d(exact, keep))} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
