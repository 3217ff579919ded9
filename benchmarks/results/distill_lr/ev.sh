#!/bin/bash
# usage: ev.sh MODEL.onnx HELD_FOLDER — mAP50 and mAP50-95 against nudenet's YOLOv8n 320 on the held-out photos
cd "$(git rev-parse --show-toplevel)"
M=$(ls .venv/lib/python3*/site-packages/nudenet/320n.onnx)
.venv/bin/python -m onnxprune eval "$1" --images "$2" --ref "$M" --input-shape 1x3x320x320 --mean 0,0,0 --std 1,1,1 \
    2>&1 | awk -F'│' 'NF>5{print $2,$4,$5}'
