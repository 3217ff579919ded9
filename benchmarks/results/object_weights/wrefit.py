"""Prototype: refit the DFL box convs (cv2.i.2, 1x1) by least squares weighted towards the anchors where the teacher
sees objects."""
import argparse, sys
from pathlib import Path
import numpy as np, onnx, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import onnxprune
from onnxprune.runtime.torch_eval import TorchGraph
from onnxprune.tasks import infer_task
from third_party import wheel_file
from detector_distill import images, iou
from onnx import numpy_helper

p = argparse.ArgumentParser()
p.add_argument("--pruned", default="/tmp/det07/yolov8n-320_0.7_default.onnx")
p.add_argument("--train", default="/tmp/det07/yolov8n-320_calib")
p.add_argument("--held", default="/tmp/det07/yolov8n-320_held")
p.add_argument("--floor", type=float, default=0.01, help="weight of a background anchor")
p.add_argument("--ridge", type=float, default=1e-3)
p.add_argument("--branches", default="cv2")
p.add_argument("--flip", action="store_true")
a = p.parse_args()
teacher = onnxprune.load(wheel_file("nudenet", "320n.onnx"), ["1x3x320x320"])
pre = onnxprune.preprocess_for(teacher, input_shape=["1x3x320x320"], mean=(0, 0, 0), std=(1, 1, 1))
train, held = images(Path(a.train), teacher, pre), images(Path(a.held), teacher, pre)
if a.flip:
    train = np.concatenate([train, train[..., ::-1].copy()])
student = onnx.load(a.pruned)
out0 = teacher.graph.output[0].name
nodes = {n.name: n for n in student.graph.node}
convs = [f"/model.22/{b}.{i}/{b}.{i}.2/Conv" for b in a.branches.split(",") for i in range(3)]
ins = [nodes[c].input[0] for c in convs]
outs = [nodes[c].output[0] for c in convs]
def run(model, x, names):
    net = TorchGraph(model, outputs=names)
    with torch.no_grad():
        return [torch.cat(z).numpy() for z in zip(*[net(torch.from_numpy(x[i:i+32])) for i in range(0, len(x), 32)])]
t_all = run(teacher, train, [out0] + outs)
s_in = run(student, train, ins)
task = infer_task([t_all[0][:1]], (320, 320), 1)
tb, tsc, _ = task.layout.candidates([t_all[0]])
w = tsc.max(-1)
w = np.where(w >= 0.05, w, 0.0) + a.floor
inits = {i.name: i for i in student.graph.initializer}
k = {}
start = 0
levels = [(40, 40), (20, 20), (10, 10)]
offs = np.cumsum([0] + [h * ww for h, ww in levels])
for c, x, t in zip(convs, s_in, t_all[1:]):
    i = int(c.split("/")[2].split(".")[1])
    wt = w[:, offs[i]:offs[i + 1]].reshape(-1)
    n, ci, h, ww = x.shape
    X = x.transpose(0, 2, 3, 1).reshape(-1, ci).astype(np.float64)
    X = np.concatenate([X, np.ones((len(X), 1))], 1)
    T = t.transpose(0, 2, 3, 1).reshape(-1, t.shape[1]).astype(np.float64)
    A = (X * wt[:, None]).T @ X
    A += a.ridge * np.trace(A) / len(A) * np.eye(len(A))
    B = (X * wt[:, None]).T @ T
    sol = np.linalg.solve(A, B)
    node = nodes[c]
    W = numpy_helper.to_array(inits[node.input[1]])
    Wn = sol[:-1].T.reshape(W.shape).astype(np.float32)
    bn = sol[-1].astype(np.float32)
    inits[node.input[1]].CopyFrom(numpy_helper.from_array(Wn, node.input[1]))
    inits[node.input[2]].CopyFrom(numpy_helper.from_array(bn, node.input[2]))
def measure(model):
    t = run(teacher, held, [out0])[0]; y = run(model, held, [out0])[0]
    m = task.metric(); m.update([y], [t]); r = m.result()
    ious = []
    for ref, mine in zip(task.layout.decode([t], 0.25, 0.5), task.layout.decode([y], 0.25, 0.5)):
        for box, c in zip(ref.boxes, ref.classes):
            same = mine.boxes[mine.classes == c]
            ious.append(float(iou(box, same).max()) if len(same) else 0.0)
    return round(r["mAP50-95_ref"], 4), round(r["mAP50_ref"], 4), round(float(np.median(ious)), 4)
print(vars(a))
print("before", measure(onnx.load(a.pruned)), "after", measure(student), flush=True)
