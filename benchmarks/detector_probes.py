"""A detector calibrated on images mostly without objects: nudenet's YOLOv8n 320 at ``--ratio`` on three calibration
sets, judged by mAP50-95 against the original's detections on 59 photos held out, with the report's count of
probe samples with objects. Run it at two commits to see what a change to the probes does.

Of the dev photos, the original finds objects (score ≥ 0.25) on 117 in name order: the first 58 calibrate
(``obj58``), the next 59 are held out (``held``); ``mix`` is ``obj58`` plus every second photo without objects (192),
``pool`` every photo but the held-out ones (441, 58 with objects). Folders of links in ``--out``.

    python benchmarks/detector_probes.py --out /tmp/probes            # obj58, mix, pool at 0.70
    python benchmarks/detector_probes.py --out /tmp/probes --sets mix
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import CLI, DEFAULT_DATA, run
from detectors import link, with_objects
from onnxprune.calib.images import list_images
from third_party import wheel_file

FLAGS = ["--input-shape", "1x3x320x320", "--mean", "0,0,0", "--std", "1,1,1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photo folder")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ratio", default="0.7")
    parser.add_argument("--sets", default="obj58,mix,pool")
    args = parser.parse_args()
    model = wheel_file("nudenet", "320n.onnx")
    pool = list_images(args.data)
    found = with_objects(model, pool, FLAGS, len(pool))
    held = link(found[58:117], args.out / "held")
    empty = [p for p in pool if p not in set(found)]
    sets = {"obj58": found[:58], "mix": found[:58] + empty[::2], "pool": [p for p in pool if p not in set(found[58:117])]}
    for name in args.sets.split(","):
        calib = link(sets[name], args.out / name)
        pruned, report = args.out / f"{name}.onnx", args.out / f"{name}.json"
        run([*CLI, "compress", str(model), "-o", str(pruned), "--calib", str(calib), "--target-ratio", args.ratio,
             "--report", str(report), "--quiet", *FLAGS])
        scores = json.loads(run([*CLI, "eval", str(pruned), "--images", str(held), "--ref", str(model), "--json",
                                 *FLAGS]))["metrics"]
        allocation = json.loads(report.read_text())["allocation"]
        print(f"{name}: {len(sets[name])} photos, probes with objects {allocation['with_objects']} of "
              f"{allocation['probe_samples']}, mAP50-95 {scores['mAP50-95_ref']:.3f} (mAP50 {scores['mAP50_ref']:.3f}) "
              f"on {len(found[58:117])} held-out photos", flush=True)


if __name__ == "__main__":
    main()
