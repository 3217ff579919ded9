"""Prototype (not in the product): `recover` of nudenet's YOLOv8n 320 with the distillation at a fixed learning rate,
printing the training loss every 10 steps and the held-out loss at each of 15 checkpoints, and writing the trained
model even where never-worse would return the input (the second verdict is reported 10 lower), so that it can be
scored on photos `recover` never saw (``ev.sh``).

    python benchmarks/results/distill_lr/distill_lr.py STUDENT.onnx CALIB_FOLDER LR SECONDS OUT.onnx

LR ``auto``: recover's own choice of the rate (its trials) and its own five checkpoints instead of 15.
"""
import glob
import sys
import time

import onnx

import onnxprune
from onnxprune.recovery import run as recover_run
from onnxprune.recovery import stages, train
from onnxprune.recovery.options import RecoverOptions

student, calib, seconds, out = sys.argv[1], sys.argv[2], float(sys.argv[4]), sys.argv[5]
fixed = {} if sys.argv[3] == "auto" else {"lr": float(sys.argv[3]), "evals": 15}
teacher = glob.glob(".venv/lib/python3*/site-packages/nudenet/320n.onnx")[0]
pre = onnxprune.preprocess_for(teacher, input_shape=["1x3x320x320"], mean=(0, 0, 0), std=(1, 1, 1))
real_fit, real_held, real_discrepancy = stages.fit, train.held_loss, recover_run.discrepancy


def fit(*args, **kwargs):
    t0 = time.time()

    def on_step(step: int, value: float, best: float) -> None:
        if step % 10 == 0 or step < 5:
            print(f"step {step} train {value:.4f} best held {best:.4f} {time.time() - t0:.0f}s", flush=True)

    return real_fit(*args, **{**kwargs, "on_step": on_step, **fixed})


def held_loss(*args, **kwargs) -> float:
    value = real_held(*args, **kwargs)
    print("held", round(value, 4), flush=True)
    return value


verdicts = []


def discrepancy(*args, **kwargs):
    metric, value, agreement = real_discrepancy(*args, **kwargs)
    verdicts.append(value)
    print("verdict", metric, value, flush=True)
    return metric, value - 10 if len(verdicts) == 2 else value, agreement


stages.fit, train.held_loss, recover_run.discrepancy = fit, held_loss, discrepancy
result = onnxprune.recover(student, teacher, calib, options=RecoverOptions(time=seconds), preprocess=pre,
                           input_shape=["1x3x320x320"])
onnx.save(result.model, out)
