"""Prototype (the figures of README.md here): whole-network distillation of a pruned MobileNetV2, logits KL + block
outputs, teacher and student on the same augmented views; trains on photos !0,1%5, prints the KL / top-1 on 1%5 (h)
and 0%5 (t) at each check. Run from the repository root; not the product's code path."""
import time, math, argparse
import numpy as np, onnx, torch, torch.nn.functional as F
from pathlib import Path
from onnxprune.calib.sources import preprocess_for
from onnxprune.calib.images import label_from_name, list_images, select
from onnxprune.runtime.torch_eval import TorchGraph
from onnxprune.recovery.segments import find_segments
from onnxprune.ir.load import import_graph
from onnxprune.recovery.augment import mix

p = argparse.ArgumentParser()
p.add_argument("student"); p.add_argument("--seconds", type=float, default=600)
p.add_argument("--lr", type=float, default=1e-4); p.add_argument("--res", type=int, default=224)
p.add_argument("--feat", type=float, default=1.0); p.add_argument("--bs", type=int, default=32)
p.add_argument("--ema", type=float, default=0.0); p.add_argument("--mix", default="mixup")
p.add_argument("--evals", type=int, default=6); p.add_argument("--threads", type=int, default=2)
p.add_argument("--minarea", type=float, default=0.25)
p.add_argument("--teacher", default="artifacts/mobilenet_v2.onnx")
p.add_argument("--data", default="../shared/data/imagenet-sample-dev")
a = p.parse_args()
torch.set_num_threads(a.threads)
D = Path(a.data)
teacher = onnx.load(a.teacher); student = onnx.load(a.student)
specs = [(i.name, [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim], None) for i in teacher.graph.input]
pre = preprocess_for([(n, s, None) for n, s, _ in specs])
def load(sub):
    paths = select(list_images(D), sub)
    x = np.stack([pre(pp) for pp in paths]).astype(np.float32)
    return torch.from_numpy(x), np.array([label_from_name(pp) for pp in paths])
t0 = time.time()
xtr, _ = load("!0,1%5"); xh, yh = load("1%5"); xt, yt = load("0%5")
print("loaded", xtr.shape, time.time() - t0, flush=True)
segs = find_segments(import_graph(student), import_graph(teacher))
anchors = [s.end[0] for s in segs[:-1]]
out = teacher.graph.output[0].name
print("anchors", len(anchors), flush=True)
S = TorchGraph(student, outputs=[out] + anchors); T = TorchGraph(teacher, outputs=[out] + anchors)
T.requires_grad_(False)
params = [p_ for p_ in S.parameters()]
print("params", sum(p_.numel() for p_ in params))
def logits(net, x, bs=100):
    with torch.no_grad():
        return torch.cat([net(x[i:i+bs])[0] for i in range(0, len(x), bs)])
tl_h, tl_t = logits(T, xh), logits(T, xt)
def judge():
    sh, st = logits(S, xh), logits(S, xt)
    kl = lambda s, t: float((F.softmax(t, 1) * (F.log_softmax(t, 1) - F.log_softmax(s, 1))).sum(1).mean())
    return dict(kl_h=kl(sh, tl_h), kl_t=kl(st, tl_t), top1_t=float((st.argmax(1).numpy() == yt).mean()),
                agree_t=float((st.argmax(1) == tl_t.argmax(1)).float().mean()), top1_h=float((sh.argmax(1).numpy() == yh).mean()))
print("before", judge(), flush=True)
gen = torch.Generator().manual_seed(0)
opt = torch.optim.Adam(params, lr=a.lr)
ema = [p_.detach().clone() for p_ in params] if a.ema else None
def aug(x):
    n = len(x)
    side = torch.empty(n).uniform_(a.minarea, 1.0, generator=gen).sqrt()
    asp = torch.exp(torch.empty(n).uniform_(math.log(3/4), math.log(4/3), generator=gen)).sqrt()
    sx, sy = (side*asp).clamp(max=1), (side/asp).clamp(max=1)
    tx = (torch.rand(n, generator=gen)*2-1)*(1-sx); ty = (torch.rand(n, generator=gen)*2-1)*(1-sy)
    flip = torch.where(torch.rand(n, generator=gen) < .5, -1., 1.)
    th = torch.zeros(n, 2, 3); th[:,0,0], th[:,0,2], th[:,1,1], th[:,1,2] = sx*flip, tx, sy, ty
    grid = F.affine_grid(th, [n, 3, a.res, a.res], align_corners=False)
    return mix(F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False), gen, a.mix)
start = time.time(); step = 0; next_eval = 1
while True:
    share = (time.time() - start) / a.seconds
    if share >= 1: break
    for g in opt.param_groups: g["lr"] = a.lr * 0.5 * (1 + math.cos(math.pi * share))
    idx = torch.randint(len(xtr), (a.bs,), generator=gen)
    x = aug(xtr[idx])
    with torch.no_grad(): to = T(x)
    so = S(x)
    loss = (F.softmax(to[0], 1) * (F.log_softmax(to[0], 1) - F.log_softmax(so[0], 1))).sum(1).mean()
    if a.feat:
        for s_, t_ in zip(so[1:], to[1:]):
            loss = loss + a.feat / len(anchors) * ((s_ - t_)**2).mean() / (t_**2).mean().clamp_min(1e-12)
    opt.zero_grad(); loss.backward(); opt.step(); step += 1
    if ema:
        with torch.no_grad():
            for e, p_ in zip(ema, params): e.mul_(a.ema).add_(p_.detach(), alpha=1-a.ema)
    if share >= next_eval / a.evals:
        next_eval += 1
        r = {}
        if ema:
            cur = [p_.detach().clone() for p_ in params]
            with torch.no_grad():
                for p_, e in zip(params, ema): p_.copy_(e)
            r = {"ema_" + k: v for k, v in judge().items()}
            with torch.no_grad():
                for p_, c in zip(params, cur): p_.copy_(c)
        print(f"t={time.time()-start:.0f}s step={step} loss={loss.item():.4f}", judge(), r, flush=True)
print("final", step, time.time() - start, judge(), flush=True)
