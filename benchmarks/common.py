"""What the MobileNetV2 benchmark scripts share: the photos, the original model, and the `onnxprune` commands
run in-process: their flags read by the CLI's own parser (``onnxprune.cli.flag_values``) and built into the API's
objects by ``onnxprune.flags.jobs``, as the CLI builds them. No `onnxprune` flag is declared here; ``split_flags``
declares the scripts' own choice of split."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

import onnxprune
import onnxprune.ir.probe
from onnxprune.flags import jobs
from onnxprune.flags import deploy as deploy_flags
from onnxprune.cli import flag_values, torch_threads
from onnxprune.fileio import atomic_write

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/imagenet-sample-dev"
CLI = [sys.executable, "-m", "onnxprune"]
# Recovery protocol on the 500 dev photos: prune and train on 300, pick checkpoints on 100 the pruner
# did not see, test on the 100 of fold 0 (index % 5 == 0).
RECOVER_TRAIN, RECOVER_HELD, RECOVER_TEST = "!0,1%5", "1%5", "0%5"


CLASS_BLOCKS = 4  # a class-range split tests on one of four blocks of 125 photos (250 classes each)


def recover_subsets(fold: int, classes: int | None = None) -> tuple[str, str, str]:
    """The protocol's (train, held, test) subsets with every set shifted by ``fold`` fifths (fold 1: train on
    index % 5 not in {1, 2}, hold out 2%5, test on 1%5). ``classes`` k: the split by class range instead, which
    tests on photos whose classes nothing trained on (the dev photos are one per even class, so an index fold's
    test photos have near neighbours among the training ones): test on block k of ``CLASS_BLOCKS`` (photos
    125k:125(k+1), classes 250k to 250k+249), hold out the other blocks' photos with index % 5 == 1, train on the
    rest of them (300 photos, as a fold)."""
    if classes is not None:
        test = f"{125 * classes}:{125 * (classes + 1)}"
        return f"!{test}&!1%5", f"!{test}&1%5", test
    if fold == 0:
        return RECOVER_TRAIN, RECOVER_HELD, RECOVER_TEST
    a, b = fold % 5, (fold + 1) % 5
    return f"!{a},{b}%5", f"{b}%5", f"{a}%5"


def split_flags(parser: argparse.ArgumentParser) -> None:
    """``--fold`` and ``--classes``: the split ``recover_subsets`` makes, as every recovery script chooses it."""
    parser.add_argument("--fold", type=int, choices=range(5), default=0,
                        help="shift every photo set by this many fifths (1: train on the photos with index %% 5 not in "
                             "{1, 2}, hold out 2%%5, test on 1%%5; the second fold of docs/results.md)")
    parser.add_argument("--classes", type=int, choices=range(4), default=None,
                        help="k: split by class range instead of --fold: test on photos 125k:125(k+1)")


def every_flag(parser: argparse.ArgumentParser) -> None:
    """``--recover-every k``: `recover` trains on the split's training photos whose index is a multiple of k
    (`compress` still calibrates on all of them), as every recovery script measures what fewer photos cost."""
    parser.add_argument("--recover-every", type=int, default=1,
                        help="k: recover on the training photos whose index is a multiple of k (compress on all of "
                             "them): what fewer photos cost")


def thinned(calib: str, every: int) -> str:
    """The subset of ``calib`` `recover` trains on under ``--recover-every every``."""
    return calib if every == 1 else f"{calib}&0%{every}"


def split_of(fold: int, classes: int | None) -> dict[str, int]:
    """How a result names the split ``recover_subsets(fold, classes)`` made: ``{"fold": k}`` or ``{"classes": k}``
    (what ``recovery_pooled.py`` reads)."""
    return {"fold": fold} if classes is None else {"classes": classes}


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


def _echo(*words: object) -> None:
    """The `onnxprune` command line equivalent to an in-process call, on stderr (as `run` echoes commands)."""
    print("$ onnxprune", shlex.join(map(str, words)), file=sys.stderr, flush=True)


def analyze(model: Path, input_shape: list[str] | None = None) -> dict:
    """`onnxprune analyze --json` of ``model`` (with ``--input-shape``), in-process."""
    _echo("analyze", model, "--json", *(f"--input-shape={s}" for s in input_shape or ()))
    return onnxprune.analyze(model, input_shape).to_dict()


def macs(model: Path) -> int:
    """The MACs of ``model`` (`onnxprune analyze --json`'s ``macs``)."""
    return analyze(model)["macs"]


def forward_seconds(model: Path, data: Path, subset: str, flags: list[str] = (), passes: int = 2) -> float:
    """Seconds of ``passes`` plain onnxruntime passes of ``model`` (CPU) over the calibration tensors that
    `onnxprune compress model --calib data --subset subset *flags` reads (decoded beforehand, not timed), one sample
    at a time where an input's batch is static, else the faster of batches of 1 and of 32 (batch 32 ran 1.3-2×
    slower than small batches on large inputs): the reference a compress time is put against."""
    import onnxruntime as ort

    values = flag_values("compress", [str(model), "-o", "unused.onnx", "--calib", str(data), "--subset", subset,
                                      "--target-ratio", "0.5", *flags])
    job = jobs.compress_job(values)
    session = ort.InferenceSession(job.model.SerializeToString(), providers=["CPUExecutionProvider"])
    times = []
    for batch in (1,) if onnxprune.ir.probe.static_batch(job.model) else (1, 32):
        feeds = list(job.data.batches(batch))
        start = time.perf_counter()
        for _ in range(passes):
            for feed in feeds:
                session.run(None, feed)
        times.append(time.perf_counter() - start)
    return min(times)


def evaluate(model: Path, original: Path, data: Path, subset: str, flags: list[str] = ()) -> dict:
    """`onnxprune eval model --images data --subset subset --ref original --json *flags`, in-process: the flags
    read by the CLI's own parser, the result built as the CLI builds it (``onnxprune.flags.jobs``)."""
    _echo("eval", model, "--images", data, "--subset", subset, "--ref", original, "--json", *flags)
    values = flag_values("eval", [str(model), "--images", str(data), "--subset", subset, "--ref", str(original), *flags])
    return deploy_flags.evaluate(values).to_dict()


def compress(original: Path, output: Path, data: Path, flags: list[str], report: Path | None = None) -> dict:
    """`onnxprune compress original -o output --calib data *flags [--report report]`, in-process (the flags read
    and built as the CLI does): writes ``output`` (and ``report``) and returns the report's dict. A model the
    library refuses raises its OnnxPruneError (``onnxprune.cli.error_line`` is the line the CLI prints)."""
    _echo("compress", original, "-o", output, "--calib", data, *flags, *(("--report", report) if report else ()))
    values = flag_values("compress", [str(original), "-o", str(output), "--calib", str(data), *flags])
    job = jobs.compress_job(values)
    result = job.run()
    if job.recovery is not None:
        result = result.recover(job.recovery, held=job.held)
    result.save(output, refuse=[original])
    if report is not None:
        atomic_write(report, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
    return result.to_dict()


def recover(pruned: Path, original: Path, output: Path, data: Path, flags: list[str], report: Path | None = None
            ) -> dict:
    """`onnxprune recover pruned --teacher original -o output --calib data *flags [--report report]`, in-process
    (the flags read and built as the CLI does), torch's threads as the CLI sets them (restored after): writes
    ``output`` (and ``report``) and returns the report's dict."""
    _echo("recover", pruned, "--teacher", original, "-o", output, "--calib", data, *flags,
          *(("--report", report) if report else ()))
    values = flag_values("recover", [str(pruned), "--teacher", str(original), "-o", str(output), "--calib", str(data),
                                     *flags])
    job = jobs.recover_job(values)
    threads = torch.get_num_threads()
    torch_threads()
    try:
        result = job.run()
    finally:
        torch.set_num_threads(threads)
    result.save(output, refuse=[pruned, original])
    if report is not None:
        atomic_write(report, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
    return result.to_dict()


def quantize(model: Path, output: Path, data: Path, flags: list[str], report: Path | None = None) -> dict:
    """`onnxprune quantize model -o output --calib data *flags [--report report]`, in-process (the flags read and
    built as the CLI does): writes ``output`` (and ``report``) and returns the report's dict."""
    _echo("quantize", model, "-o", output, "--calib", data, *flags, *(("--report", report) if report else ()))
    result = deploy_flags.quantize(flag_values("quantize", [str(model), "-o", str(output), "--calib", str(data),
                                                            *flags]))
    result.save(output, refuse=[model])
    if report is not None:
        atomic_write(report, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
    return result.to_dict()


def bench(models: list[Path], flags: list[str]) -> list[dict]:
    """`onnxprune bench *models *flags --json`, in-process (the flags read and built as the CLI does)."""
    _echo("bench", *models, *flags, "--json")
    return [r.to_dict() for r in deploy_flags.bench(flag_values("bench", [*map(str, models), *flags]))]
