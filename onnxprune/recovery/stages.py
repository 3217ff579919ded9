"""The two stages of ``recover``: block-wise reconstruction, and distillation of the head (on cached augmented views)
or of the whole model (augmented on the fly)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.recovery.augment import augment_images, steer
from onnxprune.recovery.objective import objective, with_features
from onnxprune.recovery.options import (
    DISTILL_LRS, ROUND_SHARE, VIEWS_SHARE, Augment, Clock, Progress, RecoverOptions,
)
from onnxprune.recovery.report import DistillReport, RecoverReport, SegmentReport
from onnxprune.recovery.samples import discrepancy
from onnxprune.recovery.segments import Segment, head_start, windows
from onnxprune.recovery.train import distill, evaluate_net, fit, kl_loss, softened_kl
from onnxprune.ir.cuts import run_segment
from onnxprune.ir.store import Array, Store
from onnxprune.torch.engine import TorchGraph, write_back
from onnxprune.tasks import Detect


def block_stage(s_model: onnx.ModelProto, t_graph: gs.Graph, segments: list[Segment],
                 values: dict[str, Array], train_idx: np.ndarray, held_idx: np.ndarray,
                 options: RecoverOptions, report: RecoverReport, on_progress: Progress | None, store: Store,
                 clock: Clock, round_: int = 1) -> tuple[onnx.ModelProto, dict[str, Array]]:
    """Train every changed segment in turn, ``block_window`` of them together (``windows``), but one that the
    distillation trains whole (``left_to_distill``); the written model and the trained nets' outputs. Under a time
    budget every loop gets an equal share, the distillation's loop counted in the first round (``block_share``);
    a later round (``another_round``) shares what is left among the windows alone."""
    n = len(next(iter(values.values())))
    distill = options.method.distill and round_ == 1
    whole = distill and head_start(segments, options.distill_segments, options.train == "changed") is None
    segments, _, train = block_plan(segments, options)
    steps = options.step_counts()[0]
    stage = clock.loop(block_share(len(train), distill, options.whole_share if whole else None)) if train else None
    stage_end = None if stage is None else time.monotonic() + stage
    cur = dict(values)  # student tensors at the current anchor (all samples)
    ref = dict(values)  # teacher tensors at the same anchor
    model, trainable, done = s_model, len(train), 0
    for i, seg in enumerate(segments):
        t0 = time.perf_counter()
        if on_progress is not None:  # the passes over every sample take minutes at 640² before any loop
            on_progress(f"block stage: the teacher's tensors at {seg.end[0]}{clock.label()}", i, len(segments), None)
        net = TorchGraph(s_model, outputs=seg.end, inputs_at=seg.start).to(options.torch_device())
        xs = [cur[name] for name in net.input_names]
        new_ref, _ = run_segment(t_graph, ref, seg.end, provider=options.provider, batch_size=options.batch_size,
                                 store=store)
        if i in train:
            ts = [new_ref[name] for name in seg.end]
            names = set(seg.changed) if options.train == "changed" else None
            params = [p for name, p in net.named_initializers()
                      if isinstance(p, torch.nn.Parameter) and (names is None or name in names)]
            label = f"block {done + 1}/{trainable} → {seg.end[0]}" + (f" (round {round_})" if round_ > 1 else "")

            seconds = None if stage_end is None else max(1.0, (stage_end - time.monotonic()) / (trainable - done))

            def step(k: int, loss: float, held: float, label: str = label, seconds: float | None = seconds) -> None:
                if on_progress is not None:
                    on_progress(label + clock.label(), k, steps if seconds is None else k, held)

            result = fit(net, params, xs, ts, train_idx, held_idx, steps=steps, lr=options.lr,
                         batch_size=options.batch_size, pull=options.pull, seed=options.seed + done, on_step=step,
                         seconds=seconds, optimizer=options.optimizer)
            done += 1
            report.segments.append(SegmentReport(seg.end, sum(p.numel() for p in params), result.held_before,
                                                 result.held_after, result.best_step, time.perf_counter() - t0,
                                                 result.stopped, round_))
            model = write_back(model, net)
        ref = {**{k: v for k, v in ref.items() if k in values}, **new_ref}
        ys = evaluate_net(net, xs, np.arange(n), options.batch_size, store)
        cur = {**{k: v for k, v in cur.items() if k in values}, **dict(zip(seg.end, ys))}
    return model, cur


def block_plan(segments: list[Segment], options: RecoverOptions) -> tuple[list[Segment], int | None, list[int]]:
    """The block stage's segments (``windows`` of them; one the distillation trains whole stays one: ``left_to_
    distill``), the index of that one (None without), and the indices of those it trains."""
    skip = left_to_distill(segments, options)
    if skip is None:
        segments = windows(segments, options.block_window)
    else:
        before = windows(segments[:skip], options.block_window)
        segments, skip = before + segments[skip:], len(before)
    return segments, skip, [i for i, s in enumerate(segments) if s.trainable and i != skip]


def block_share(loops: int, distill: bool, whole: float | None = None) -> float:
    """Of the time left, what the block stage's ``loops`` get: as much each as a head distillation's one loop that
    follows them (all of it without one; a fixed share gave MobileNetV2's head distillation 60% of the time, where it
    never improved on the block stage's output), or all but ``whole`` (``RecoverOptions.whole_share``) of it before a
    distillation of the whole model, whose steps cost a pass of both networks each."""
    if not distill:
        return 1.0
    return loops / (loops + 1) if whole is None else 1.0 - whole


def another_round(clock: Clock, report: RecoverReport) -> bool:
    """Whether the block windows train once more from the weights they reached: where time is left after every
    stage (a loop stopped early and gave its time on, the last one included: MobileNetV2's head distillation kept
    its start and left 76-84 s of 900), at least ``ROUND_SHARE`` of the budget, and the last round's windows gained
    (one whose every window kept its start would spend the time again for nothing)."""
    left = clock.left()
    if left is None or left < ROUND_SHARE * clock.seconds or not report.segments:
        return False
    last = report.segments[-1].round
    return any(s.best_step > 0 for s in report.segments if s.round == last)


def left_to_distill(segments: list[Segment], options: RecoverOptions) -> int | None:
    """The first segment of a distilled head, where it is the head's only changed one (a detector whose neck holds
    no single tensor alive makes one segment of neck and head, before its unchanged box decoding): the distillation
    trains it whole, from the same tensors, on the task objective with augmented views; the block stage would
    train the same weights on the raw squared error of its end without them, spending the time twice. None
    otherwise."""
    if not options.method.distill:
        return None
    first = head_start(segments, options.distill_segments, options.train == "changed")
    changed = [] if first is None else [i for i in range(first, len(segments)) if segments[i].trainable]
    return first if changed == [first] else None


def _augmenter(model: onnx.ModelProto, options: RecoverOptions) -> tuple[str, Augment | None]:
    """Crop/flip/mix for a model with one 4-D float input, else None (and why); the description names the share
    ``distill_stage`` steers."""
    inits = {t.name for t in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in inits]
    image = (len(inputs) == 1 and len(inputs[0].type.tensor_type.shape.dim) == 4
             and inputs[0].type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                                           onnx.TensorProto.DOUBLE))
    steered = f", {options.steer:.0%} steered to random classes" if options.steer else ""
    if not image:
        return f"none (the model does not take one batch of images){steered}", None
    colour = f"colour ±{options.colour:.0%}, " if options.colour else ""
    mosaics = f"{options.mosaic:.0%} mosaics, " if options.mosaic else ""
    leaves = f"{options.leaves:.0%} dead leaves, " if options.leaves else ""
    what = f"random resized crop, flip, {colour}{mosaics}{leaves}{options.mix}{steered} ({options.layout})"
    return what, lambda xs, gen: [augment_images(xs[0], gen, options.mix, options.layout, colour=options.colour,
                                                 mosaics=options.mosaic, leaves=options.leaves)]


def distill_stage(model: onnx.ModelProto, teacher: onnx.ModelProto, t_graph: gs.Graph, segments: list[Segment],
                   values: dict[str, Array], train_idx: np.ndarray, held_idx: np.ndarray,
                   teacher_held: list[np.ndarray], task: Detect | None, options: RecoverOptions,
                   on_progress: Progress | None, store: Store, clock: Clock) -> tuple[onnx.ModelProto, list[np.ndarray], DistillReport]:
    """Distillation of the head (the last ``distill_segments`` segments, reaching back to weights to train:
    ``head_start``; on cached augmented views) or of the whole model (augmented on the fly); the written model,
    its held-out outputs, the report."""
    t0 = time.perf_counter()
    first = head_start(segments, options.distill_segments, options.train == "changed")
    changed = {name for seg in segments for name in seg.changed}
    augment, transform = _augmenter(model, options)
    loss = objective(teacher_held, task)
    trained = softened_kl(options.temperature) if loss is kl_loss else loss
    outputs = [o.name for o in model.graph.output]
    steps = options.step_counts()[1]

    def step(k: int, value: float, best: float) -> None:
        if on_progress is not None:
            on_progress("distill" + clock.label(), k, steps if clock.seconds is None else k, best)

    def trainable(net: TorchGraph) -> list[torch.nn.Parameter]:
        return [p for name, p in net.named_initializers()
                if isinstance(p, torch.nn.Parameter) and (options.train == "segment" or name in changed)]

    lr = DISTILL_LRS if options.distill_lr is None else options.distill_lr
    loop = {"steps": steps, "lr": lr, "pull": options.pull, "seed": options.seed,
            "on_step": step, "average": options.average, "optimizer": options.optimizer}
    if first is not None:
        start = segments[first].start
        net = TorchGraph(model, outputs=outputs, inputs_at=start)
        xs, ts, n_views = _head_views(model, t_graph, start, values, train_idx, held_idx, teacher_held, transform,
                                      options, store, clock.loop(VIEWS_SHARE),
                                      None if on_progress is None else
                                      lambda k, n: on_progress("distill: caching augmented views" + clock.label(), k,
                                                               n, None))
        params = trainable(net.to(options.torch_device()))
        held_part = np.arange(n_views, len(xs[0]))
        result = fit(net, params, xs, ts, np.arange(n_views), held_part, batch_size=options.batch_size, loss=trained,
                     held_by=loss, pool=options.pool, seconds=clock.loop(), **loop)
        held_out = evaluate_net(net, xs, held_part, options.batch_size)
        samples = n_views
    else:
        start = [i.name for i in model.graph.input]
        anchors = [seg.end[0] for seg in segments[:-1]] if options.distill_features > 0 else []
        net = TorchGraph(model, outputs=outputs + anchors).to(options.torch_device())
        t_net = TorchGraph(teacher, outputs=outputs + anchors).to(options.torch_device())
        t_net.requires_grad_(False)
        xs = [values[name] for name in net.input_names]
        params = trainable(net)

        def held() -> float:
            return discrepancy(evaluate_net(net, xs, held_idx, options.batch_size, first=len(outputs)), teacher_held,
                               task)[1]

        def inputs(xs: list[torch.Tensor], gen: torch.Generator) -> list[torch.Tensor]:
            xs = transform(xs, gen) if transform else xs
            return [steer(xs[0], lambda x: t_net(x)[0], gen, options.steer)] if options.steer else xs

        result = distill(net, t_net, params, xs, train_idx, held, batch_size=options.batch_size, pool=options.pool,
                         augment=inputs,
                         loss=with_features(trained, len(outputs), options.distill_features), seconds=clock.loop(),
                         **loop)
        held_out = evaluate_net(net, xs, held_idx, options.batch_size, first=len(outputs))
        samples = result.steps * options.batch_size
    report = DistillReport(sum(p.numel() for p in params), first is None, list(start), samples, augment,
                           result.held_before, result.held_after, result.best_step, time.perf_counter() - t0,
                           result.lr, result.trials, result.stopped)
    return write_back(model, net), held_out, report


def _head_views(model: onnx.ModelProto, t_graph: gs.Graph, start: list[str], values: dict[str, Array],
                train_idx: np.ndarray, held_idx: np.ndarray, teacher_held: list[np.ndarray],
                transform: Augment | None, options: RecoverOptions, store: Store, seconds: float | None,
                on_view: Callable[[int, int], None] | None = None) -> tuple[list[Array], list[Array], int]:
    """The student's tensors at ``start`` and the teacher's outputs for ``distill_views`` augmented
    views of the training samples (fewer where the next would end past ``seconds``; one at least, of as many
    training samples as its first batch's time says fit in ``seconds``), followed by the held-out samples (not
    augmented); the count of views' samples. ``on_view(k, views)`` before view k."""
    names = [i.name for i in model.graph.input if i.name in values]
    outputs = [o.name for o in model.graph.output]
    s_graph, gen = gs.import_onnx(model), torch.Generator().manual_seed(options.seed)
    bs, views, n = options.batch_size, options.distill_views if transform else 1, len(train_idx)
    parts: list[tuple[dict[str, Array], dict[str, Array]]] = []
    begin = time.monotonic()

    def run(feed: dict[str, Array], rows: np.ndarray | slice) -> tuple[dict[str, Array], dict[str, Array]]:
        part = {n_: feed[n_][rows] for n_ in names}
        return tuple(run_segment(g, part, ends, provider=options.provider, batch_size=bs, store=store)[0]
                     for g, ends in ((s_graph, start), (t_graph, outputs)))

    for k in range(views):  # one view of every training sample at a time
        if seconds is not None and k and (time.monotonic() - begin) * (k + 1) / k > seconds:
            break
        if on_view is not None:
            on_view(k, views)
        feed = {n_: store.empty((n, *values[n_].shape[1:]), values[n_].dtype) for n_ in names}
        for s in range(0, n, bs):  # mixing stays within a batch
            batch = [torch.from_numpy(values[n_][train_idx[s : s + bs]]) for n_ in names]
            for n_, b in zip(names, transform(batch, gen) if transform else batch):
                feed[n_][s : s + len(b)] = b.numpy()
        if k or seconds is None or n <= bs:
            parts.append(run(feed, slice(0, n)))
            continue
        # the first view: its first batch's time says how many batches fit, spread over the samples (YOLOv8s at
        # 640² spent 120 s of a one-minute budget on one view of 349 photos)
        t0 = time.monotonic()
        first = run(feed, slice(0, bs))
        batches = -(-n // bs)
        fit = 1 + max(0, int((seconds - (time.monotonic() - begin)) / max(time.monotonic() - t0, 1e-9)))
        chosen = np.unique(np.linspace(1, batches - 1, min(fit, batches) - 1).round().astype(int))
        rows = np.concatenate([np.arange(bs)] + [np.arange(c * bs, min(n, (c + 1) * bs)) for c in chosen])
        whole = len(rows) == n  # a slice, not a copy, of a feed that may be spilled to disk
        train_idx, n = train_idx[rows], len(rows)
        rest = None if n <= bs else run(feed, slice(bs, n) if whole else rows[bs:])
        parts.append(first if rest is None else tuple({k_: store.concat([a[k_], b[k_]]) for k_ in a}
                                                      for a, b in zip(first, rest)))
    held_in, _ = run_segment(s_graph, {n_: store.copy(values[n_], held_idx) for n_ in names}, start,
                             provider=options.provider, batch_size=bs, store=store)
    xs = [store.concat([p[0][n_] for p in parts] + [held_in[n_]]) for n_ in start]
    ts = [store.concat([p[1][n_] for p in parts] + [t]) for n_, t in zip(outputs, teacher_held)]
    return xs, ts, len(parts) * n
