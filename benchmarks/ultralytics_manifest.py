"""Ultralytics' own YOLOv8n through the road to PyTorch and back: built from the package's yaml (its norms warmed on
photos), each C2f rewritten as two convs (the halves the pruning narrows apart: Torch-Pruning's ``C2f_v2``; without
it ``apply_manifest`` refuses the C2fs, see ``--keep-c2f``), exported by Ultralytics, pruned by ``compress``, the
manifest applied to the Ultralytics model (outputs against the pruned ONNX's), one training step with Ultralytics'
own loss, exported again by Ultralytics (inputs and outputs against the pruned ONNX's). Writes ``<out>/report.json``.

ultralytics needs torchvision, which does not import beside the CPU torch of the project's venv: run it in the venv
of ``corpus_ultralytics.py`` (the package on the path, and onnx-graphsurgeon installed there)::

    /tmp/ulvenv/bin/pip install onnx-graphsurgeon
    PYTHONPATH=. /tmp/ulvenv/bin/python benchmarks/ultralytics_manifest.py --out benchmarks/results/ultralytics_manifest
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

import onnxprune
from onnxprune.calib.images import list_images, select
from onnxprune.ir.ort import make_session
from onnxprune.strategies import Ratio, Uniform
from onnxprune.torch import apply_manifest, save_manifest

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "imagenet-sample-dev"
SHAPE = "1x3x320x320"


class C2fTwoConvs(nn.Module):
    """Ultralytics' C2f with its first conv as one conv a half (Torch-Pruning's ``C2f_v2``): the same outputs."""

    def __init__(self, c2f: nn.Module) -> None:
        from ultralytics.nn.modules.conv import Conv

        super().__init__()
        c, first = c2f.c, c2f.cv1
        self.cv0, self.cv1 = (Conv(first.conv.in_channels, c, 1, 1) for _ in range(2))
        for i, half in enumerate((self.cv0, self.cv1)):
            rows = slice(i * c, (i + 1) * c)
            half.conv.weight.data.copy_(first.conv.weight.data[rows])
            for name in ("weight", "bias", "running_mean", "running_var"):
                getattr(half.bn, name).data.copy_(getattr(first.bn, name).data[rows])
        self.m, self.cv2 = c2f.m, c2f.cv2
        self.f, self.i, self.type, self.np = c2f.f, c2f.i, "C2fTwoConvs", c2f.np  # what DetectionModel's loop reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = [self.cv0(x), self.cv1(x)]
        y.extend(m(y[-1]) for m in self.m)
        return self.cv2(torch.cat(y, 1))


def two_convs(model: nn.Module) -> int:
    """Every C2f of ``model`` replaced by its ``C2fTwoConvs`` (in place); how many."""
    from ultralytics.nn.modules.block import C2f

    count = 0
    for name, child in model.named_children():
        if type(child) is C2f:
            setattr(model, name, C2fTwoConvs(child))
            count += 1
        else:
            count += two_convs(child)
    return count


def photos(data: Path, subset: str, size: int = 320) -> torch.Tensor:
    """The photos of ``subset`` as YOLO reads them: RGB in [0, 1], resized to ``size``² (no letterbox)."""
    from PIL import Image

    return torch.stack([torch.from_numpy(np.asarray(Image.open(p).convert("RGB").resize((size, size)),
                                                    np.float32) / 255).permute(2, 0, 1)
                        for p in select(list_images(data), subset)])


def exported(yolo: object, work: Path) -> Path:
    """Ultralytics' ONNX export of ``yolo`` (static, 320², its default opset), in ``work``."""
    cwd = os.getcwd()
    os.chdir(work)
    try:
        return Path(yolo.export(format="onnx", imgsz=320, simplify=False)).resolve()
    finally:
        os.chdir(cwd)


def io(path: Path) -> dict:
    """A model's inputs and outputs, by name, with their shapes."""
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = lambda v: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]  # noqa: E731
    return {"inputs": {v.name: dims(v) for v in graph.input}, "outputs": {v.name: dims(v) for v in graph.output}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="photos (calibration, norms, the check)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ultralytics_manifest"))
    parser.add_argument("--ratio", type=float, default=0.7, help="MACs kept")
    parser.add_argument("--keep-c2f", action="store_true",
                        help="export the C2fs as they are (apply_manifest refuses halves pruned apart)")
    parser.add_argument("--uniform", action="store_true", help="the same ratio for every group (Uniform allocation)")
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from ultralytics import YOLO
    from ultralytics.cfg import get_cfg

    torch.manual_seed(0)
    yolo = YOLO("yolov8n.yaml")
    model = yolo.model
    model.train()
    with torch.no_grad():  # the norms warmed on photos, in batches of 16
        for batch in photos(a.data, "0:64").split(16):
            model(batch)
    report: dict = {"ultralytics": __import__("ultralytics").__version__, "torch": torch.__version__,
                    "c2f_rewritten": 0 if a.keep_c2f else two_convs(model)}
    model.eval()
    original = copy.deepcopy(model)
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = exported(yolo, Path(tmp))
        preprocess = onnxprune.preprocess_for(str(onnx_path), input_shape=[SHAPE], mean=(0, 0, 0), std=(1, 1, 1))
        result = onnxprune.compress(str(onnx_path), str(a.data), subset="64:128", budget=Ratio(a.ratio),
                                    input_shape=[SHAPE], preprocess=preprocess,
                                    **({"allocate": Uniform()} if a.uniform else {}))
        pruned_path = a.out / "yolov8n_pruned.onnx"
        result.save(pruned_path)
        entries = result.manifest()
        save_manifest(entries, a.out / "kept.json")
        report.update(macs=[result.report.macs_before, result.report.macs_after], io_original=io(onnx_path),
                      io_pruned=io(pruned_path), manifest_nodes=len(entries))
    try:
        apply_manifest(model, entries)
    except onnxprune.OnnxPruneError as exc:
        report["refused"] = str(exc)
        (a.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report, indent=1))
        return
    x = photos(a.data, "400:404")
    session, _ = make_session(onnx.load(str(pruned_path)), "cpu")
    want = np.concatenate([session.run(None, {session.get_inputs()[0].name: x[i:i + 1].numpy()})[0]
                           for i in range(len(x))])
    with torch.no_grad():
        got = model(x)[0].numpy()
    report.update(params=[sum(p.numel() for p in original.parameters()), sum(p.numel() for p in model.parameters())],
                  module_vs_pruned_onnx=float(np.abs(got - want).max() / np.abs(want).max()))
    # one step of Ultralytics' own training loss on photos with made-up boxes (class 0, one box a photo)
    args, model.args = model.args, get_cfg()  # the loss reads its gains there; the exporter reads a dict
    model.train()
    images = photos(a.data, "128:136")
    batch = {"img": images, "batch_idx": torch.arange(len(images), dtype=torch.float32),
             "cls": torch.zeros(len(images), 1), "bboxes": torch.tensor([[0.5, 0.5, 0.4, 0.6]]).repeat(len(images), 1)}
    optimiser = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loss, items = model.loss(batch)
    optimiser.zero_grad()
    loss.sum().backward()
    optimiser.step()
    report["loss"] = ({k: float(v.sum()) for k, v in items.items()} if isinstance(items, dict)
                      else [float(v) for v in items])  # box, cls and dfl losses (a dict in recent versions)
    model.args = args
    # Ultralytics' export folds each Conv's norm: a norm the pruned export had folded already is the identity now
    from ultralytics.nn.modules.conv import Conv

    for m in model.modules():
        if isinstance(m, Conv) and isinstance(getattr(m, "bn", None), nn.Identity):
            del m.bn
            m.forward = m.forward_fuse
    model.eval()
    yolo.model = model
    with tempfile.TemporaryDirectory() as tmp:
        again = exported(yolo, Path(tmp))
        report["io_after_training"] = io(again)
        session, _ = make_session(onnx.load(str(again)), "cpu")
        trained = session.run(None, {session.get_inputs()[0].name: x[:1].numpy()})[0]
        with torch.no_grad():
            module = model(x[:1])[0].numpy()
        report["trained_export_vs_module"] = float(np.abs(trained - module).max() / np.abs(module).max())
    report["same_io_as_pruned"] = report["io_after_training"] == report["io_pruned"]
    (a.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
