"""Peak resident memory of one ``compress``, phase by phase: a sampler thread reads the process's RSS every 0.2 s
and keeps the highest per progress label (the phase and group ``compress`` reports).

    python benchmarks/corpus_torch.py --only pt_keras_like_unet_nhwc_256_static_op13.onnx
    python benchmarks/peak_rss.py benchmarks/results/third_party_models/made/pt_keras_like_unet_nhwc_256_static_op13.onnx \\
        --subset 0:32 --mean 0,0,0 --std 1,1,1
"""

from __future__ import annotations

import argparse
import os
import resource
import threading
import time
from pathlib import Path

import onnxprune
from common import DEFAULT_DATA


def rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--subset", default="0:32")
    parser.add_argument("--ratio", type=float, default=0.85)
    parser.add_argument("--mean", default="0.485,0.456,0.406")
    parser.add_argument("--std", default="0.229,0.224,0.225")
    args = parser.parse_args()
    label, peaks = ["start"], {}

    def watch() -> None:
        while True:
            key = label[0].split(":")[0][:48]
            peaks[key] = max(peaks.get(key, 0), rss())
            time.sleep(0.2)

    threading.Thread(target=watch, daemon=True).start()
    start = time.perf_counter()
    mean, std = (tuple(float(v) for v in text.split(",")) for text in (args.mean, args.std))
    result = onnxprune.compress(str(args.model), str(args.data), subset=args.subset, budget=onnxprune.Ratio(args.ratio),
                                preprocess=onnxprune.preprocess_for(str(args.model), mean=mean, std=std),
                                on_layer=lambda i, n, text: label.__setitem__(0, text))
    print(f"{time.perf_counter() - start:.0f} s, peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB;"
          f" plan: {result.report.memory}")
    for key, value in sorted(peaks.items(), key=lambda kv: -kv[1])[:10]:
        print(f"{value / 2**30:6.2f} GiB  {key}")


if __name__ == "__main__":
    main()
