"""The objects of the API that the flags' values build: the preprocessing, the calibration samples, the budget, and
the jobs of compress, recover and sweep."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from onnxprune import api
from onnxprune.calib.images import Preprocess
from onnxprune.deploy.quantize import QuantizeOptions
from onnxprune.errors import OnnxPruneError, OptionError, TargetError
from onnxprune.flags.declared import ALLOCATION, Values
from onnxprune.flags.parse import numbers, parse_duration, parse_latency, parse_macs, parse_target
from onnxprune.recovery import RecoverOptions
from onnxprune.ir.store import memory_bytes
from onnxprune.strategies import Latency, MACs, Ratio, named
from onnxprune.sweep import SweepResult, SweepRow, sweep as run_sweep


def preprocess(model: api.ModelSource, values: Values) -> Preprocess:
    """The image preprocessing of the flags for ``model``; --input-shape sizes the crop of a model given as a path
    (a loaded model has its shapes already)."""
    shapes = None if isinstance(model, onnx.ModelProto) else values.get("input_shape")
    return api.preprocess_for(model, input_shape=shapes, resize=values["resize"], crop=values["crop"],
                              mean=numbers(values["mean"]), std=numbers(values["std"]), layout=values["layout"],
                              bgr=values["bgr"])


def calibration(values: Values, model: onnx.ModelProto, prep: Preprocess, held_subset: str | None
                ) -> tuple[api.CalibrationSet, api.CalibrationSet | None]:
    """The calibration samples of the flags (--calib, --subset, --limit, --flip), and the held-out ones of
    ``held_subset`` (None without it)."""
    data = api.calibration(values["calib"], model, prep, subset=values["subset"], limit=values["limit"],
                           flip=values["flip"])
    return data, None if held_subset is None else api.calibration(values["calib"], model, prep, subset=held_subset)


def budget(values: Values) -> MACs | Ratio | Latency:
    """The budget of compress's target flags (exactly one of them)."""
    flops, ratio, latency = values["target_flops"], values["target_ratio"], values["target_latency"]
    cost_table, save_cost_table = values["cost_table"], values["save_cost_table"]
    if [flops, ratio, latency].count(None) != 2:
        raise TargetError("give exactly one of --target-flops (e.g. 245M), --target-ratio (e.g. 0.8) or "
                          "--target-latency (e.g. 3.5ms or 0.8x)")
    if (cost_table or save_cost_table) and not latency:
        raise TargetError("--cost-table and --save-cost-table go with --target-latency")
    if flops:
        return MACs(parse_macs(flops))
    if ratio is not None:
        return Ratio(ratio)
    latency_ms, latency_ratio = parse_latency(latency)
    return Latency(latency_ms, latency_ratio, values["latency_batch"], values["threads"],
                   cost_table and str(cost_table), save_cost_table and str(save_cost_table))


@dataclass
class CompressJob:
    """What compress's flags ask for, checked and loaded: ``run`` prunes; ``recovery`` is the recovery that
    --recover-steps asks for after it (None: none), on the ``held`` samples of --recover-held-subset."""

    model: onnx.ModelProto
    data: api.CalibrationSet
    held: api.CalibrationSet | None
    options: dict[str, Any]  # api.compress's keywords
    recovery: RecoverOptions | None
    int8: QuantizeOptions | None = None  # --int8: the quantization of the written model

    def run(self, on_layer: Callable[[int, int, str], None] | None = None) -> api.Result:
        return api.compress(self.model, self.data, **self.options, on_layer=on_layer)


def compress_job(values: Values) -> CompressJob:
    """The budget and the strategies first (a wrong flag fails before any loading), then the model, its
    preprocessing and the calibration samples."""
    v = values
    chosen = budget(v)
    if v["recover_held_subset"] is not None and v["recover_steps"] < 1:
        raise OnnxPruneError("--recover-held-subset goes with --recover-steps N (N ≥ 1)")
    select, allocate, reconstruct = named(v["method"], allocation(v), v["reconstruct"], v["target"], v["seed"],
                                          v["remove_blocks"], v["global_budget"])
    model = api.load(v["model"], v["input_shape"])
    prep = preprocess(model, v)
    data, held = calibration(v, model, prep, v["recover_held_subset"])
    options = dict(budget=chosen, select=select, allocate=allocate, reconstruct=reconstruct, preprocess=prep,
                   round_to=v["round_to"], batch_size=v["batch_size"], provider=v["provider"],
                   best_effort=v["best_effort"], residual_streams=v["residual_streams"], memory=v["memory"],
                   spill_dir=v["spill_dir"], task=v["task"], empty_samples=v["empty_samples"])
    recovery = None if v["recover_steps"] < 1 else RecoverOptions(
        steps=v["recover_steps"], batch_size=v["batch_size"], provider=v["provider"], seed=v["seed"], **_store(v))
    return CompressJob(model, data, held, options, recovery, int8(v))


def allocation(values: Values) -> str:
    """--allocation, or where it is not given the library's default, but 'recover' for a model compress trains
    after pruning (--recover-steps): recover mends the first layers' error on new photos, not the last ones'
    (benchmarks/results/notebook/recovery-3.md)."""
    if values["allocation"] is not None:
        return values["allocation"]
    return "recover" if values.get("recover_steps", 0) >= 1 else ALLOCATION


def int8(values: Values) -> QuantizeOptions | None:
    """The quantization that --int8 asks for (in --runtime's layout, judged by --task, widening its float prefix to
    --max-loss), None without it; --max-loss without --int8 is an OptionError."""
    if values["max_loss"] is not None and not values["int8"]:
        raise OptionError("--max-loss bounds the INT8 model's loss: give it with --int8", option="max_loss")
    return (QuantizeOptions(runtime=values["runtime"], task=values["task"], max_loss=values["max_loss"])
            if values["int8"] else None)


def _store(values: Values) -> dict[str, Any]:
    """RecoverOptions' ``memory`` (bytes) and ``spill_dir`` (text) from --memory and --spill-dir."""
    return {"memory": memory_bytes(values["memory"]), "spill_dir": values["spill_dir"] and str(values["spill_dir"])}


@dataclass
class RecoverJob:
    """What recover's flags ask for, checked and loaded: ``run`` trains."""

    student: onnx.ModelProto
    teacher: onnx.ModelProto
    data: api.CalibrationSet
    held: api.CalibrationSet | None  # the --held-subset samples
    options: RecoverOptions

    def run(self, on_progress: Callable[[str, int, int, float | None], None] | None = None) -> api.Result:
        return api.recover(self.student, self.teacher, self.data, options=self.options, held=self.held,
                           on_progress=on_progress)


def recover_job(values: Values) -> RecoverJob:
    """The student and the teacher, the preprocessing (the teacher's), the options and the calibration samples."""
    v = values
    student, teacher = api.load(v["model"], v["input_shape"]), api.load(v["teacher"], v["input_shape"])
    prep = preprocess(teacher, v)
    options = RecoverOptions(method=v["method"], steps=v["steps"], lr=v["lr"], block_window=v["block_window"],
                             distill_steps=v["distill_steps"], distill_lr=v["distill_lr"],
                             distill_segments=v["distill_segments"], distill_views=v["distill_views"],
                             distill_features=v["distill_features"], mix=v["mix"],
                             colour=v["colour"], mosaic=v["mosaic"], leaves=v["leaves"], steer=v["steer"],
                             whole_share=v["whole_share"],
                             temperature=v["temperature"], pool=v["pool"], average=v["average"],
                             layout=prep.layout,
                             batch_size=v["batch_size"], holdout=v["holdout"], train=v["train"], pull=v["pull"],
                             optimizer=v["optimizer"],
                             seed=v["seed"], provider=v["provider"], time=parse_duration(v["time"]), **_store(v))
    data, held = calibration(v, teacher, prep, v["held_subset"])
    return RecoverJob(student, teacher, data, held, options)


def sweep(values: Values, on_layer: Callable[[int, int, str], None] | None = None) -> SweepResult:
    """sweep's flags: the budgets of --targets (and --keep's search) on one calibration, judged on --held."""
    v = values
    select, allocate, reconstruct = named(v["method"], allocation(v), v["reconstruct"])
    model = api.load(v["model"], v["input_shape"])
    targets = dict(parse_target(t) for t in (v["targets"] or "").split(",") if t.strip())
    if not targets and v["keep"] is None:
        raise OnnxPruneError("give --targets (e.g. 0.9,0.8,0.7,0.6 or 245M,170M), --keep (e.g. 0.95), or both")
    return run_sweep(model, v["calib"], targets, v["output"], held=v["held"], keep=v["keep"], subset=v["subset"],
                     flip=v["flip"], preprocess=preprocess(model, v), select=select, allocate=allocate,
                     reconstruct=reconstruct, round_to=v["round_to"], batch_size=v["batch_size"],
                     provider=v["provider"], memory=v["memory"], task=v["task"], bench=v["bench"], int8=int8(v),
                     on_layer=on_layer)


def keep(values: Values, on_layer: Callable[[int, int, str], None] | None = None
         ) -> tuple[SweepResult, SweepRow, Path]:
    """compress --keep: the sweep's search (no targets, every fifth --calib image held out, no timing) into
    <output>.sweep/; the result, the chosen row and that folder."""
    if any(values[k] is not None for k in ("target_flops", "target_ratio", "target_latency")):
        raise TargetError("--keep chooses the budget itself: leave out --target-flops/--target-ratio/--target-latency")
    if values["recover_steps"]:
        raise OnnxPruneError("--keep and --recover-steps do not go together: recover the chosen model afterwards")
    folder = values["output"].with_name(values["output"].stem + ".sweep")
    result = sweep({**values, "targets": None, "output": folder, "held": None, "bench": False}, on_layer)
    return result, next(r for r in result.rows if r.target == result.keep["chosen"]), folder
