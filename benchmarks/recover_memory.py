"""Peak resident memory and time of `onnxprune recover` by calibration set size.

    python benchmarks/recover_memory.py --student STUDENT.onnx --teacher TEACHER.onnx --calib CROPS/ --samples 500,2000 \\
        --out benchmarks/results/recover_memory -- --memory 1G --steps 2 --distill-steps 2

Runs `onnxprune recover` once per size on the first N samples of ``--calib`` (e.g. the crops `speed.py
--samples --crops-dir` writes) with the extra flags after ``--``, and records its wall time and peak RSS (the
process's maxrss, from wait4). Writes `<out>/recover_memory.json` and `.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(student: Path, teacher: Path, calib: Path, n: int, flags: list[str], tmp: Path) -> dict:
    cmd = [sys.executable, "-m", "onnxprune", "recover", str(student), "--teacher", str(teacher), "-o",
           str(tmp / "recovered.onnx"), "--calib", str(calib), "--limit", str(n), *flags]
    print("$", shlex.join(cmd), flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), cmd)
    return {"samples": n, "flags": flags, "seconds": time.perf_counter() - start,
            "peak_rss_bytes": usage.ru_maxrss * 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--student", type=Path, required=True)
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--calib", type=Path, required=True)
    parser.add_argument("--samples", default="500,2000")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/recover_memory"))
    parser.add_argument("extra", nargs="*", help="recover flags (after --)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="onnxprune-recover-") as tmp:
        rows = [run(args.student, args.teacher, args.calib, int(n), args.extra, Path(tmp))
                for n in args.samples.split(",")]
    lines = ["| samples | seconds | peak RSS | vs first |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['samples']} | {r['seconds']:.0f} | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                     f"{r['peak_rss_bytes'] / rows[0]['peak_rss_bytes']:.2f}× |")
    table = "\n".join(lines) + f"\n\nrecover flags: {' '.join(args.extra) or '(defaults)'}\n"
    (args.out / "recover_memory.json").write_text(json.dumps(rows, indent=2))
    (args.out / "recover_memory.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
