"""Wall time of `onnxprune compress` on the real MobileNetV2 with all dev photos as calibration.

    python benchmarks/speed.py [--data DIR] [--images 500] [--target 245M] [-- extra compress flags]

Prints the total and per-layer times from the report, and writes `<out>/speed.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

from common import DEFAULT_DATA, original_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--images", type=int, default=500)
    parser.add_argument("--target", default="245M")
    parser.add_argument("extra", nargs="*", help="extra compress flags (after --)")
    args = parser.parse_args()
    if not args.data.is_dir():
        sys.exit(f"error: {args.data} is not a folder of photos: pass --data")
    args.out.mkdir(parents=True, exist_ok=True)
    original = original_model(args.out)
    pruned, report = args.out / "speed.onnx", args.out / "speed_report.json"
    cmd = [sys.executable, "-m", "onnxprune", "compress", str(original), "-o", str(pruned), "--calib", str(args.data),
           "--limit", str(args.images), "--target-flops", args.target, "--report", str(report), *args.extra]
    print("$", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    rep = json.loads(report.read_text())
    pruned.unlink()
    report.unlink()
    result = {
        "images": rep["calibration_samples"], "target": args.target, "macs_after": rep["macs_after"],
        "compress_seconds": rep["seconds"], "wall_seconds_incl_startup": wall, "provider": rep["provider"],
        "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "layers": [{"group": layer["group"], "kept": layer["kept"], "channels": layer["channels"],
                    "seconds": layer["seconds"]} for layer in rep["layers"]],
    }
    (args.out / "speed.json").write_text(json.dumps(result, indent=2))
    for layer in result["layers"]:
        print(f"{layer['group']:60} {layer['kept']:5}/{layer['channels']:<5} {layer['seconds']:6.1f}s")
    print(f"compress: {rep['seconds']:.1f}s for {result['images']} calibration images on {rep['provider']} "
          f"({result['cores']} cores); {wall:.1f}s including start-up")


if __name__ == "__main__":
    main()
