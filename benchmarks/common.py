"""What the MobileNetV2 benchmark scripts share: the photos, the original model, running the CLI."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-dev"
CLI = [sys.executable, "-m", "onnxprune"]
# Recovery protocol on the 500 dev photos: prune and train on 300, pick checkpoints on 100 the pruner
# did not see, test on the 100 of fold 0 (index % 5 == 0).
RECOVER_TRAIN, RECOVER_HELD, RECOVER_TEST = "!0,1%5", "1%5", "0%5"


def run(args: list[str]) -> str:
    """Run a command (echoed to stderr) and return its stdout; fail on a non-zero exit."""
    print("$", shlex.join(args), file=sys.stderr, flush=True)
    return subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True).stdout


def original_model(out: Path) -> Path:
    """The real ImageNet MobileNetV2 in ``out``, built on first use."""
    path = out / "mobilenet_v2.onnx"
    if not path.exists():
        run([sys.executable, "-m", "models", "mobilenet_v2", "-o", str(path)])
    return path


def evaluate(model: Path, original: Path, data: Path, subset: str) -> dict:
    """`onnxprune eval --json` of ``model`` against ``original`` on photos ``subset``."""
    return json.loads(run([*CLI, "eval", str(model), "--images", str(data), "--subset", subset,
                           "--ref", str(original), "--json"]))
