"""Exports of the third-party corpus made through ultralytics' own exporter, in each of its export styles: models
built from the YAML configs the package ships (random weights: they test structure, time and memory, not
fidelity), exported static and dynamic, detect / seg / pose / obb / classify, NMS-free end-to-end (YOLOv10,
YOLO26) and with the NMS in the graph, and RT-DETR.

ultralytics needs torchvision, which does not import beside the CPU torch of the project's venv: run this in a
venv of its own, then ``benchmarks/third_party.py`` (in the project's venv) finds the files.

    python3 -m venv /tmp/ulvenv
    /tmp/ulvenv/bin/pip install torch==2.14.1 torchvision==0.29.1 ultralytics onnx onnxslim
    /tmp/ulvenv/bin/python benchmarks/corpus_ultralytics.py    # writes benchmarks/results/third_party_models/made/
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from corpus_args import selected

# file name -> (YAML config, export keyword arguments)
EXPORTS: dict[str, tuple[str, dict]] = {
    "ul_yolov8n_det_320_dynamic.onnx": ("yolov8n.yaml", dict(imgsz=320, dynamic=True)),
    "ul_yolo11n_det_640_static.onnx": ("yolo11n.yaml", dict(imgsz=640)),
    "ul_yolo11n_det_320_opset11.onnx": ("yolo11n.yaml", dict(imgsz=320, opset=11)),
    "ul_yolo11n_seg_320_static.onnx": ("yolo11n-seg.yaml", dict(imgsz=320)),
    "ul_yolo11n_seg_640_static.onnx": ("yolo11n-seg.yaml", dict(imgsz=640)),
    "ul_yolo11n_pose_320_dynamic.onnx": ("yolo11n-pose.yaml", dict(imgsz=320, dynamic=True)),
    "ul_yolo11n_obb_320_static.onnx": ("yolo11n-obb.yaml", dict(imgsz=320)),
    "ul_yolo11n_cls_224_dynamic.onnx": ("yolo11n-cls.yaml", dict(imgsz=224, dynamic=True)),
    "ul_yolov10n_e2e_320_static.onnx": ("yolov10n.yaml", dict(imgsz=320)),
    "ul_yolo26n_e2e_320_static.onnx": ("yolo26n.yaml", dict(imgsz=320)),
    "ul_yolo11n_nms_320_static.onnx": ("yolo11n.yaml", dict(imgsz=320, nms=True)),
    "ul_rtdetr_l_320_static.onnx": ("rtdetr-l.yaml", dict(imgsz=320)),
}


def main() -> None:
    out, names, _ = selected(__doc__, EXPORTS)
    from ultralytics import RTDETR, YOLO

    for name in names:
        config, kwargs = EXPORTS[name]
        kind = RTDETR if config.startswith("rtdetr") else YOLO
        with tempfile.TemporaryDirectory() as work:
            saved = Path(work) / Path(config).with_suffix(".pt").name
            kind(config).save(str(saved))  # export writes beside the weights file
            shutil.copy(kind(str(saved)).export(format="onnx", **kwargs), out / name)
        print(out / name)


if __name__ == "__main__":
    main()
