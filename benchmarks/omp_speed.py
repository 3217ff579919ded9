"""Seconds of one group OMP path (``imitation.omp.group_omp``) on random statistics shaped like a dense 3×3 layer:
N channels of k columns each (D = N·k), O outputs, P positions, to ``--width`` channels. Run it under the thread
settings to compare (``OMP_NUM_THREADS``, ``OMP_WAIT_POLICY``) and at two commits to time a change to the kernel;
it prints the path's order digest, so two runs can be checked to choose the same channels.

    python benchmarks/omp_speed.py                         # N 512, k 9, O 512, P 1568 (ResNet-34's layer4), width 300
    OMP_NUM_THREADS=1 python benchmarks/omp_speed.py --width 384
    python benchmarks/omp_speed.py --stats --channels 4096 --k 1 --outputs 4096 --positions 32 --width 1024  # a Gemm head

``--stats`` goes the way ``compress`` does, through streamed ``ConsumerStats`` and ``stats_omp`` (which narrows the
cross to the positions where they are fewer than the outputs).
"""

from __future__ import annotations

import argparse
import hashlib
import time

import numpy as np

from onnxprune.imitation.omp import group_omp, stats_omp
from onnxprune.imitation.gram import ConsumerStats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--k", type=int, default=9, help="columns per channel (a 3×3 consumer: 9)")
    parser.add_argument("--outputs", type=int, default=512)
    parser.add_argument("--positions", type=int, default=1568)
    parser.add_argument("--width", type=int, default=300)
    parser.add_argument("--stats", action="store_true", help="through ConsumerStats and stats_omp, as compress")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    d = args.channels * args.k
    x = rng.standard_normal((args.positions, d)) * rng.uniform(0.1, 2, d)
    t = x @ rng.standard_normal((d, args.outputs)) * 0.01 + rng.standard_normal((args.positions, args.outputs))
    if args.stats:
        stats = ConsumerStats(d, args.outputs)
        stats.update(x.astype(np.float32), t.astype(np.float32))
        start = time.perf_counter()
        path = stats_omp([stats], [args.k], args.width)
    else:
        a, b, e = x.T @ x / args.positions, x.T @ t / args.positions, float((t * t).sum() / args.positions)
        start = time.perf_counter()
        path = group_omp([a], [b], [e], [args.k], args.width, ridge=1e-4)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256(path.order.tobytes()).hexdigest()[:16]
    print(f"group OMP, N {args.channels} k {args.k} O {args.outputs} P {args.positions} to width {args.width}: "
          f"{seconds:.2f} s (order {digest})")


if __name__ == "__main__":
    main()
