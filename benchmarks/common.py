"""What the MobileNetV2 benchmark scripts share: the photos, the original model, and the `onnxprune` commands
run in-process through the Python API (their flags read as the CLI reads them)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import onnx
import torch

import onnxprune
from onnxprune import RecoverOptions, strategies
from onnxprune.api import parse_macs
from onnxprune.calib.images import IMAGENET_MEAN, IMAGENET_STD
from onnxprune.deploy.cost import parse_latency
from onnxprune.fileio import atomic_write

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


def evaluate(model: Path, original: Path, data: Path, subset: str, flags: list[str] = ()) -> dict:
    """`onnxprune eval model --images data --subset subset --ref original --json *flags`, in-process through
    ``onnxprune.evaluate`` (flags: --input-shape and the image flags)."""
    _echo("eval", model, "--images", data, "--subset", subset, "--ref", original, "--json", *flags)
    a = _image_flags(argparse.ArgumentParser(prog="onnxprune eval", exit_on_error=False)).parse_args(list(flags))
    return onnxprune.evaluate(model, data, original, subset=subset, preprocess=_preprocess(model, a),
                              provider=a.provider, task=a.task).to_dict()


def _image_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``p`` with the flags of the image preprocessing, --input-shape, --provider and --task (the CLI's
    defaults)."""
    p.add_argument("--input-shape", action="append")
    for flag in ("--resize", "--crop"):
        p.add_argument(flag, type=int)
    p.add_argument("--mean", default=",".join(map(str, IMAGENET_MEAN)))
    p.add_argument("--std", default=",".join(map(str, IMAGENET_STD)))
    p.add_argument("--layout", default="auto")
    p.add_argument("--task", default="auto")
    p.add_argument("--bgr", action="store_true")
    p.add_argument("--provider", default="auto")
    return p


def _preprocess(model: Path | onnx.ModelProto, a: argparse.Namespace) -> onnxprune.Preprocess:
    """The image preprocessing of the flags for ``model`` (as the CLI builds it)."""
    def floats(text: str) -> tuple[float, ...]:
        return tuple(float(v) for v in text.split(","))

    return onnxprune.preprocess_for(model, input_shape=a.input_shape, resize=a.resize, crop=a.crop,
                                    mean=floats(a.mean), std=floats(a.std), layout=a.layout, bgr=a.bgr)


def _compress_flags() -> argparse.ArgumentParser:
    """The `onnxprune compress` flags the benchmarks pass, with the CLI's defaults."""
    p = _image_flags(argparse.ArgumentParser(prog="onnxprune compress", exit_on_error=False))
    for flag in ("--target-flops", "--target-latency", "--cost-table", "--save-cost-table", "--subset"):
        p.add_argument(flag)
    p.add_argument("--target-ratio", type=float)
    for flag, default in (("--method", "omp"), ("--allocation", "output"), ("--target", "original"),
                          ("--reconstruct", "full")):
        p.add_argument(flag, default=default)
    for flag, default in (("--latency-batch", 1), ("--round-to", 8), ("--batch-size", 32), ("--seed", 0)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--threads", type=int)
    p.add_argument("--global-budget", type=float)
    p.add_argument("--limit", type=int)
    p.add_argument("--flip", action="store_true")
    p.add_argument("--best-effort", action="store_true")
    p.add_argument("--residual-streams", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--remove-blocks", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--memory")
    p.add_argument("--spill-dir")
    return p


def _budget(a: argparse.Namespace) -> strategies.Budget:
    """The budget of the target flags (as `onnxprune compress` builds it)."""
    if a.target_flops:
        return strategies.MACs(parse_macs(a.target_flops))
    if a.target_ratio is not None:
        return strategies.Ratio(a.target_ratio)
    ms, ratio = parse_latency(a.target_latency)
    return strategies.Latency(ms, ratio, a.latency_batch, a.threads, a.cost_table, a.save_cost_table)


def compress(original: Path, output: Path, data: Path, flags: list[str], report: Path | None = None) -> dict:
    """`onnxprune compress original -o output --calib data *flags [--report report]`, in-process through
    ``onnxprune.compress``: writes ``output`` (and ``report``) and returns the report's dict. A model the
    library refuses raises its OnnxPruneError (``onnxprune.cli.error_line`` is the line the CLI prints)."""
    _echo("compress", original, "-o", output, "--calib", data, *flags, *(("--report", report) if report else ()))
    a = _compress_flags().parse_args(flags)
    budget = _budget(a)
    select, allocate, reconstruct = strategies.named(a.method, a.allocation, a.reconstruct, a.target, a.seed,
                                                     a.remove_blocks, a.global_budget)
    model = onnxprune.load(original, a.input_shape)
    result = onnxprune.compress(model, str(data), budget=budget, select=select, allocate=allocate,
                                reconstruct=reconstruct, preprocess=_preprocess(model, a), subset=a.subset,
                                limit=a.limit, flip=a.flip, round_to=a.round_to, batch_size=a.batch_size, provider=a.provider,
                                best_effort=a.best_effort, residual_streams=a.residual_streams, memory=a.memory,
                                spill_dir=a.spill_dir, task=a.task)
    result.save(output, refuse=[original])
    if report is not None:
        atomic_write(report, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
    return result.to_dict()


def _recover_flags() -> argparse.ArgumentParser:
    """The `onnxprune recover` flags the benchmarks pass, with the CLI's defaults (those of RecoverOptions)."""
    p = argparse.ArgumentParser(prog="onnxprune recover", exit_on_error=False)
    defaults = RecoverOptions()
    for name in ("method", "steps", "lr", "distill_steps", "distill_lr", "distill_segments", "distill_views", "mix",
                 "holdout", "train", "pull", "batch_size", "provider", "seed", "layout"):
        value = getattr(defaults, name)
        p.add_argument("--" + name.replace("_", "-"), type=type(value) if not isinstance(value, str) else str,
                       default=str(value) if isinstance(value, str) else value)
    for flag in ("--subset", "--held-subset"):
        p.add_argument(flag)
    return p


def recover(pruned: Path, original: Path, output: Path, data: Path, flags: list[str], report: Path | None = None
            ) -> dict:
    """`onnxprune recover pruned --teacher original -o output --calib data *flags [--report report]`, in-process
    through ``onnxprune.recover``, torch on every core as the CLI sets it (restored after): writes ``output``
    (and ``report``) and returns the report's dict."""
    _echo("recover", pruned, "--teacher", original, "-o", output, "--calib", data, *flags,
          *(("--report", report) if report else ()))
    a = vars(_recover_flags().parse_args(flags))
    subset, held_subset = a.pop("subset"), a.pop("held_subset")
    options = RecoverOptions(**a)
    teacher = onnxprune.load(original)
    held = None if held_subset is None else onnxprune.calibration(str(data), teacher, subset=held_subset)
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        result = onnxprune.recover(pruned, teacher, str(data), options=options, held=held, subset=subset)
    finally:
        torch.set_num_threads(threads)
    result.save(output, refuse=[pruned, original])
    if report is not None:
        atomic_write(report, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
    return result.to_dict()


def bench(models: list[Path], flags: list[str]) -> list[dict]:
    """`onnxprune bench *models *flags --json`, in-process through ``onnxprune.bench`` (flags: --provider,
    --batch, --threads, --warmup, --runs, --no-spin)."""
    _echo("bench", *models, *flags, "--json")
    p = argparse.ArgumentParser(prog="onnxprune bench", exit_on_error=False)
    p.add_argument("--provider", default="auto")
    for flag, default in (("--batch", 1), ("--threads", None), ("--warmup", 10), ("--runs", 50)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--no-spin", dest="spin", action="store_false")
    return [r.to_dict() for r in onnxprune.bench(models, **vars(p.parse_args(flags)))]
