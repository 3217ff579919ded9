"""Prototype: localization distillation (KL on DFL bins) for the pruned YOLOv8n."""
import argparse, json, sys, time
from pathlib import Path
import numpy as np, onnx, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import onnxprune
from onnxprune.recovery.objective import DetectLoss
from onnxprune.runtime.torch_eval import TorchGraph
from onnxprune.tasks import infer_task
from third_party import wheel_file
from detector_distill import adam_cosine, images, iou, layer, views

DFL = [f"/model.22/cv2.{i}/cv2.{i}.2/Conv_output_0" for i in range(3)]
p = argparse.ArgumentParser()
p.add_argument("--pruned", default="/tmp/det07/yolov8n-320_0.7_default.onnx")
p.add_argument("--train", default="/tmp/det07/yolov8n-320_calib")
p.add_argument("--held", default="/tmp/det07/yolov8n-320_held")
p.add_argument("--lr", type=float, default=3e-5)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--evals", type=int, default=4)
p.add_argument("--batch", type=int, default=16)
p.add_argument("--mix", default="none")
p.add_argument("--ld", type=float, default=0.0)
p.add_argument("--obj", type=float, default=1.0)
p.add_argument("--from-layer", type=int, default=5)
a = p.parse_args()
torch.manual_seed(0)
teacher = onnxprune.load(wheel_file("nudenet", "320n.onnx"), ["1x3x320x320"])
pre = onnxprune.preprocess_for(teacher, input_shape=["1x3x320x320"], mean=(0, 0, 0), std=(1, 1, 1))
train, held = images(Path(a.train), teacher, pre), images(Path(a.held), teacher, pre)
out0 = teacher.graph.output[0].name
t_net = TorchGraph(teacher, outputs=[out0] + DFL); t_net.requires_grad_(False)
s_net = TorchGraph(onnx.load(a.pruned), outputs=[out0] + DFL)
def run(net, x):
    with torch.no_grad():
        return [torch.cat(z) for z in zip(*[net(torch.from_numpy(x[i:i+32])) for i in range(0, len(x), 32)])]
t_held = run(t_net, held)
task = infer_task([t_held[0].numpy()], (320, 320), len(held))
obj = DetectLoss(task.layout)

def ld_loss(ys, ts):
    _, tsc, _ = task.layout.decoded([ts[0]])
    w = tsc.max(-1).values
    w = torch.where(w >= 0.05, w, torch.zeros_like(w))
    tot = 0.0; k = 0
    for y, t in zip(ys[1:], ts[1:]):
        n, c, h, ww = y.shape
        ly = torch.log_softmax(y.reshape(n, 4, 16, h * ww), 2)
        lt = torch.log_softmax(t.reshape(n, 4, 16, h * ww), 2)
        kl = (lt.exp() * (lt - ly)).sum(2).sum(1)  # n, hw
        tot = tot + (kl * w[:, k:k + h * ww]).sum(); k += h * ww
    return tot / w.sum().clamp_min(1e-9)

def measure():
    ys = run(s_net, held)
    m = task.metric(); m.update([ys[0].numpy()], [t_held[0].numpy()]); r = m.result()
    s = obj.sums([ys[0].double()], [t_held[0].double()])
    ious = []
    refs, mines = task.layout.decode([t_held[0].numpy()], 0.25, 0.5), task.layout.decode([ys[0].numpy()], 0.25, 0.5)
    for ref, mine in zip(refs, mines):
        for box, c in zip(ref.boxes, ref.classes):
            same = mine.boxes[mine.classes == c]
            ious.append(float(iou(box, same).max()) if len(same) else 0.0)
    return dict(map95=round(r["mAP50-95_ref"], 4), map50=round(r["mAP50_ref"], 4), score=round(float(s[0]/s[1]), 4),
                box=round(float(s[2]/s[3]), 5),
                ld=round(float(ld_loss([y.double() for y in ys], [t.double() for t in t_held])), 4),
                iou=round(float(np.median(ious)), 4))

params = []
for name, w in s_net.named_initializers():
    if isinstance(w, torch.nn.Parameter):
        on = layer(name) >= a.from_layer
        w.requires_grad_(on)
        params += [w] if on else []
print(vars(a), flush=True)
print("start", measure(), flush=True)
opt, sched = adam_cosine(params, a.lr, a.steps)
gen, t0 = torch.Generator().manual_seed(0), time.perf_counter()
for step in range(1, a.steps + 1):
    x = views(train, a.batch, a.mix, gen)
    with torch.no_grad():
        t = t_net(x)
    y = s_net(x)
    value = a.obj * obj([y[0]], [t[0]]) + (a.ld * ld_loss(y, t) if a.ld else 0)
    opt.zero_grad(); value.backward(); opt.step(); sched.step()
    if step % max(a.steps // a.evals, 1) == 0:
        print(f"step {step} ({time.perf_counter()-t0:.0f}s)", measure(), flush=True)
