"""``recover``: the samples, the teacher's outputs, the stages in order and the never-worse verdict."""

from __future__ import annotations

import time
from dataclasses import asdict, replace

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.calib.sources import CalibrationSet
from onnxprune.errors import OnnxPruneError, OptionError
from onnxprune.ir.graph import export_model, with_metadata
from onnxprune.ir.load import import_graph
from onnxprune.ir.batch import free_batch, restore_batch
from onnxprune.ir.probe import fixed_batch, static_batch
from onnxprune.ir.shapes import infer_shapes
from onnxprune.normal import untied
from onnxprune.recovery.objective import detect_task
from onnxprune.recovery.options import (
    PASSES_COST, PASSES_FLOOR, PASSES_SHARE, Clock, Progress, RecoverOptions, distill_part,
)
from onnxprune.recovery.report import RecoverReport
from onnxprune.recovery.samples import discrepancy, samples, within
from onnxprune.recovery.segments import find_segments
from onnxprune.recovery.stages import another_round, block_plan, block_stage, distill_stage
from onnxprune.recovery.verdict import confidence, scores
from onnxprune.torch.engine import writeback_error, writeback_tolerance
from onnxprune.ir.cuts import run_segment
from onnxprune.ir.store import Array

def recover(
    student: onnx.ModelProto,
    teacher: onnx.ModelProto,
    calib: CalibrationSet,
    options: RecoverOptions,
    on_progress: Progress | None = None,
    held: CalibrationSet | None = None,
) -> tuple[onnx.ModelProto, RecoverReport]:
    """Recovery of ``student`` towards ``teacher`` by ``options.method``; never returns a worse model. A weight several
    nodes share is untied first (``normal.untied``): the recovered model has one copy per reader.
    ``held``: samples that choose checkpoints and judge the result (default: a split of ``calib``); the report says on
    what share of the judging ones' bootstrap resamples the recovered weights score better (``verdict.confidence``).
    A detector whose verdict samples give both models the same mAP50-95 (few objects, found in place by both) is
    judged there by the objective it trained on, as those samples picked no checkpoint.

    Torch's global random state is seeded with ``options.seed`` for the run and restored after it (the
    caller's state is left as it was)."""
    given = student
    student, teacher = untied(student), untied(teacher)  # trained apart, as each window sees them
    s_free, t_free = _batched(student, "the pruned model"), _batched(teacher, "the teacher")
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(options.seed)
        model, report = _recover(s_free or student, t_free or teacher, calib, options, on_progress, held)
    if not report.improved:
        return given, report
    return with_metadata(model if s_free is None else restore_batch(model, given), given), report


def _batched(model: onnx.ModelProto, what: str) -> onnx.ModelProto | None:
    """A copy of ``model`` that batches freely where its input alone fixes the batch (``free_batch``: as compress
    calibrates it; the written model keeps the user's batch), None where it batches freely already; an
    OnnxPruneError where the graph fixes its batch inside (training batches samples, and would mix them)."""
    free = free_batch(model)
    if free is not None:
        return free
    static = static_batch(model)
    if static is None:
        fixed = fixed_batch(model)
        if fixed is None:
            return None
        where = f"inside the graph: {fixed.reason}"
    else:
        where = f"{static.reason}, and inside the graph, where a copy with a free batch cannot free it"
    raise OnnxPruneError(f"recover trains on batches of samples, but {what} fixes its batch ({where}): re-export it "
                         "with a dynamic batch")


def _steerable(share: float, part: int, choice: str, values: dict[str, Array]) -> None:
    """An OptionError where ``steer`` has no float input of a whole-model distillation to move (``part``: the segments
    the distillation trains, 0 = all; ``choice``: why)."""
    way_out = "leave it at 0"
    if part != 0:
        why = f"this run distils the last {part} segment{'s' if part > 1 else ''} ({choice})"
        way_out += ", or give --distill-segments 0"
    elif len(values) != 1:
        why = f"the model takes {len(values)} inputs ({', '.join(values)})"
    else:
        name, value = next(iter(values.items()))
        if value.dtype.kind == "f":
            return
        why = f"its input {name!r} holds {value.dtype}"
    raise OptionError(f"steer {share} moves the one float input of a whole-model distillation, and {why}: {way_out}",
                      option="steer")


def _recover(student: onnx.ModelProto, teacher: onnx.ModelProto, calib: CalibrationSet, options: RecoverOptions,
             on_progress: Progress | None, held: CalibrationSet | None) -> tuple[onnx.ModelProto, RecoverReport]:
    """``recover`` with torch's random state seeded."""
    start_time = time.perf_counter()
    clock = Clock(options.time)
    s_graph, t_graph = import_graph(student), import_graph(teacher)
    segments = find_segments(s_graph, t_graph)
    s_model = infer_shapes(export_model(s_graph))
    store = options.store()
    if on_progress is not None:  # reading the images and the teacher's outputs can take minutes at 640²
        on_progress("reading the samples, the teacher's and the input model's held-out outputs", 0, 1, None)
    values, train_idx, held_idx, verdict_idx = samples(calib, held, options, store)
    outputs = [t.name for t in s_graph.outputs]

    def outputs_of(model: onnx.ModelProto, idx: np.ndarray, graph: gs.Graph | None = None) -> list[np.ndarray]:
        out, _ = run_segment(graph or gs.import_onnx(model), {name: store.copy(v, idx) for name, v in values.items()},
                             outputs, provider=options.provider, batch_size=options.batch_size)
        return [out[name] for name in outputs]

    t0 = time.perf_counter()
    teacher_held, teacher_verdict = outputs_of(teacher, held_idx, t_graph), outputs_of(teacher, verdict_idx, t_graph)
    per_sample = max(time.perf_counter() - t0, 1e-9) / (len(held_idx) + len(verdict_idx))
    task = detect_task(teacher_held, [v[:1] for v in values.values()])  # a detector trains and is judged as one
    classifier = task is None and teacher_held[0].ndim == 2
    for name, what in (("temperature", "softens a classifier's probabilities"),
                       ("pool", "chooses a classifier's inputs by the KL of its probabilities"),
                       ("steer", "moves a classifier's inputs towards random classes")):
        if getattr(options, name) != getattr(RecoverOptions, name) and not classifier:
            raise OptionError(f"{name} {getattr(options, name)} {what}, and the model's first output {outputs[0]!r} "
                              f"is not a classifier's (N, classes): leave it at {getattr(RecoverOptions, name)}",
                              option=name)
    part, choice = distill_part(options, classifier, per_sample)
    if options.steer:
        _steerable(options.steer, part, choice, values)
    if options.method.distill:
        options = replace(options, distill_segments=part)
    given = len(train_idx)
    plan, skip, blocks = block_plan(segments, options) if options.method.block else ([], None, [])
    if clock.seconds is not None and blocks:  # the block stage's passes over every sample, sized to the budget
        fit = int(max(PASSES_SHARE * clock.seconds, PASSES_FLOOR) / (PASSES_COST * per_sample))
        pair = getattr(calib, "flip", False) + 1
        kept = within(train_idx, len(held_idx) + len(verdict_idx), fit, pair, least=options.batch_size // pair)
        if len(kept) < given:
            rows = np.concatenate([kept, held_idx, verdict_idx])
            values = {name: store.copy(v, rows) for name, v in values.items()}
            train_idx, held_idx, verdict_idx = np.split(np.arange(len(rows)), [len(kept), len(kept) + len(held_idx)])
    report = RecoverReport(len(train_idx), len(held_idx) + len(verdict_idx), len(verdict_idx), held is not None, "",
                           0.0, 0.0, None, None, False, device=str(options.torch_device()), options=asdict(options),
                           samples_given=given, distill_choice=choice if options.method.distill else "")
    if task is not None:
        held = [dict(enumerate(t)) for t in (teacher_held, teacher_verdict)]  # two chunks of the held-out samples
        found = task.with_objects(held)
        report.with_objects, report.verdict_with_objects = int(found.sum()), int(found[len(held_idx):].sum())
    student_verdict = outputs_of(student, verdict_idx)
    report.metric, report.before, report.agreement_before = discrepancy(student_verdict, teacher_verdict, task)

    recovered, trained_held = s_model, None
    if skip is not None:
        report.block_skipped = plan[skip].end
    if blocks:  # a stage with nothing to train would pass every sample through both models for nothing
        recovered, cur = block_stage(s_model, t_graph, segments, values, train_idx, held_idx, options, report,
                                     on_progress, store, clock)
        trained_held = [cur[name][held_idx] for name in outputs]
    if options.method.distill:
        recovered, trained_held, report.distill = distill_stage(recovered, teacher, t_graph, segments, values,
                                                                train_idx, held_idx, teacher_held, task, options,
                                                                on_progress, store, clock)
    while options.method.block and another_round(clock, report):
        recovered, cur = block_stage(recovered, t_graph, segments, values, train_idx, held_idx, options, report,
                                     on_progress, store, clock, round_=report.segments[-1].round + 1)
        trained_held = [cur[name][held_idx] for name in outputs]

    if on_progress is not None:  # passes over every sample: minutes at 640²
        on_progress("judging: the held-out and training samples, before and after", 0, 1, None)
    report.writeback_error = 0.0 if trained_held is None else max(
        writeback_error(o, t) for o, t in zip(outputs_of(recovered, held_idx), trained_held))
    tolerance = writeback_tolerance(options.torch_device())
    if not report.writeback_error <= tolerance:
        raise OnnxPruneError(f"recover: the written model differs from the trained weights by "
                             f"{report.writeback_error:.2e} (relative, onnxruntime vs torch on the held-out samples), "
                             f"past the tolerance {tolerance:.0e}: the weights were not written back faithfully, "
                             "no model is returned")
    recovered_verdict = outputs_of(recovered, verdict_idx)
    _, report.after, report.agreement_after = discrepancy(recovered_verdict, teacher_verdict, task)
    teacher_train = outputs_of(teacher, train_idx, t_graph)  # what the weights reach where they trained
    report.train_metric, report.train_before, report.train_agreement_before = discrepancy(
        outputs_of(student, train_idx), teacher_train, task)
    _, report.train_after, report.train_agreement_after = discrepancy(outputs_of(recovered, train_idx), teacher_train,
                                                                      task)
    tie = task is not None and report.after == report.before
    metric = "objective" if tie else report.metric
    before, after = (scores(metric, outs, teacher_verdict, task) for outs in (student_verdict, recovered_verdict))
    n = len(teacher_verdict[0])
    report.improved = report.after < report.before
    if tie:  # the objective on every verdict sample once, from the per-sample parts the confidence resamples
        report.tie_objective = (before(np.arange(n)), after(np.arange(n)))
        report.improved = report.tie_objective[1] < report.tie_objective[0]
    report.confidence = confidence(before, after, n, options.seed)
    report.seconds = time.perf_counter() - start_time
    return (recovered if report.improved else student), report
