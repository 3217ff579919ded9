"""Per model: how its detections match the original's (score >= conf) on the 59 held-out photos of
detectors.py's YOLOv8n 320 folders: misses (no detection of the class) and the best same-class IoU.

    python benchmarks/results/detectors_linear/match_iou.py HELD_FOLDER MODEL.onnx ...

(HELD_FOLDER: the ``yolov8n-320_held`` folder ``detectors.py --out DIR`` links.)

Its own preprocessing (short side to 320 * 256 / 224, centre crop) finds 91 reference detections where
`onnxprune eval` finds 88: a diagnosis, not the benchmark's figure."""
import glob
import sys

import numpy as np
import onnxruntime as ort
from PIL import Image

from onnxprune.tasks.detect import Detect, detection_layout
from onnxprune.tasks.detection import box_iou

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2]))
from third_party import wheel_file  # noqa: E402

H = sys.argv[1]
ref = str(wheel_file("nudenet", "320n.onnx"))
def load(p):
    im = Image.open(p).convert('RGB'); w, h = im.size; s = 320 * 256 / 224 / min(w, h)
    im = im.resize((round(w * s), round(h * s)), Image.BILINEAR); w, h = im.size
    l, t = (w - 320) // 2, (h - 320) // 2
    return np.asarray(im.crop((l, t, l + 320, t + 320)), np.float32).transpose(2, 0, 1) / 255
X = np.stack([load(p) for p in sorted(glob.glob(H + '/*'))])
def run(m):
    s = ort.InferenceSession(m, providers=['CPUExecutionProvider'])
    return [s.run(None, {s.get_inputs()[0].name: X[i:i+1]})[0] for i in range(len(X))]
R = run(ref); lay = detection_layout([R[0]], (320, 320)); task = Detect(lay)
rd = [lay.decode([r], task.conf, task.iou)[0] for r in R]
for m in sys.argv[2:]:
    Y = run(m); ious = []; miss = 0; n = 0
    for r, y in zip(rd, Y):
        d = lay.decode([y], task.conf, task.iou)[0]
        for b, c in zip(r.boxes, r.classes):
            n += 1; k = d.classes == c
            if not k.any(): miss += 1; ious.append(0); continue
            ious.append(box_iou(b[None], d.boxes[k]).max())
    ious = np.array(ious)
    shares = " ".join(f">={t}: {np.mean(ious >= t):.2f}" for t in (0.75, 0.85, 0.95))
    print(m, f"n={n} miss={miss} medianIoU={np.median(ious):.3f} {shares}")
