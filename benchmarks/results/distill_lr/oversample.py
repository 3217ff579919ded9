"""Prototype (not in the product): ``distill_lr.py`` with the head distillation's batches drawn half from the views
where the teacher finds an object (best class score ≥ 0.25 in YOLOv8's ``[N, 4 + classes, anchors]``), half from
all of them, instead of all uniformly.

    python benchmarks/results/distill_lr/oversample.py STUDENT.onnx CALIB_FOLDER LR|auto SECONDS OUT.onnx [SHARE]
"""
import runpy
import sys
from pathlib import Path

import numpy as np
import torch

from onnxprune.recovery import stages, train

share = float(sys.argv[6]) if len(sys.argv) > 6 else 0.5
sys.argv = sys.argv[:6]
real_views, real_draw = stages._head_views, train._draw
views = {}


def head_views(*args, **kwargs):
    xs, ts, n_views = real_views(*args, **kwargs)
    views["objects"] = np.flatnonzero(np.asarray(ts[0][:n_views])[:, 4:, :].max(axis=(1, 2)) >= 0.25)
    views["n"] = n_views
    print("views", n_views, "with objects", len(views["objects"]), flush=True)
    return xs, ts, n_views


def draw(idx, batch_size, gen):
    objects = views.get("objects")
    if objects is None or len(idx) != views["n"] or len(objects) == 0:
        return real_draw(idx, batch_size, gen)
    k = int(round(batch_size * share))
    return np.concatenate([objects[torch.randint(len(objects), (k,), generator=gen).numpy()],
                           idx[torch.randint(len(idx), (batch_size - k,), generator=gen).numpy()]])


stages._head_views, train._draw = head_views, draw
runpy.run_path(str(Path(__file__).with_name("distill_lr.py")), run_name="__main__")
