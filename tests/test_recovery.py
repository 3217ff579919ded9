"""Few-shot recovery (`onnxprune recover`) on the tiny MobileNetV2-like model."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
import torch

from onnxprune.ir.load import import_graph
from onnxprune.calib.sources import ArraySet, load_calibration
from onnxprune.pipeline import compress
import onnxprune.recovery
from onnxprune.errors import CalibrationError, ModelError, OnnxPruneError, OptionError
from onnxprune.recovery import METHODS, RecoverOptions, discrepancy, halves, recover, split
from onnxprune.recovery.segments import Segment, find_segments, head_start, windows
from onnxprune.recovery.options import DISTILL_LRS, HEAD_SEGMENTS, STAGE_OPTIONS
from onnxprune.recovery.samples import within
from onnxprune.ir.ort import model_input_specs
from onnxprune.strategies import Epsilon, Local, NoRefit, Ratio, Uniform, options_from
from tests.onnx_builders import export_torch, run

FAST = {"steps": 100, "distill_steps": 100, "distill_lr": 1e-2, "batch_size": 16, "provider": "cpu"}


def fast_for(method: str) -> dict:
    """``FAST`` for ``method``, without the options of the stage it does not run (refused there)."""
    left_out = {"block": STAGE_OPTIONS["distill"], "distill": STAGE_OPTIONS["block"]}.get(method, ())
    return {**{k: v for k, v in FAST.items() if k not in left_out}, "method": method}


@pytest.fixture(scope="module")
def student(tiny) -> onnx.ModelProto:
    """The tiny model at 50% of its MACs, channels and fold from local imitation, no refit: plenty to recover."""
    options = options_from(Ratio(0.5), Local(), Epsilon(), NoRefit(), provider="cpu", round_to=1)
    return compress(tiny.model, load_calibration(str(tiny.calib), model_input_specs(tiny.model)), options)[0]


def _calib(tiny, n: int | None = None):
    """The 64 calibration samples, or the first ``n``."""
    if n is None:
        return load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    name = tiny.model.graph.input[0].name
    return ArraySet({name: tiny.x}, np.arange(n), {name: np.dtype(np.float32)})


def test_segments_chain_from_input_to_output(tiny, student) -> None:
    segments = find_segments(import_graph(student), import_graph(tiny.model))
    assert segments[0].start == [i.name for i in student.graph.input]
    assert segments[-1].end == [o.name for o in student.graph.output]
    for a, b in zip(segments, segments[1:]):
        assert a.end == b.start
    assert sum(s.trainable for s in segments) >= 2
    nodes = [n for s in segments for n in s.nodes]
    assert len(nodes) == len(set(nodes)) == len(import_graph(student).nodes)


@pytest.mark.parametrize("method", METHODS)
def test_recovery_lowers_held_out_loss_and_writes_back_exactly(tiny, student, method: str) -> None:
    model, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast_for(method)))
    assert report.improved and report.after < (0.9 if "block" in method else 1.0) * report.before
    assert all(s.held_after <= s.held_before for s in report.segments)
    assert bool(report.segments) == ("block" in method)
    assert (report.distill is not None) == ("distill" in method)
    if report.distill is not None:
        assert report.distill.held_after <= report.distill.held_before
        assert report.distill.augment.startswith("random resized crop")
    assert report.writeback_error <= 1e-5
    assert report.samples_train + report.samples_held == len(tiny.x)
    onnx.checker.check_model(model)
    # the same nodes, new initializer values
    assert [n.name for n in model.graph.node] == [n.name for n in import_graph(student).nodes]
    held = tiny.x[split(len(tiny.x), 0.2)[1]]
    t = run(tiny.model, input=held)[0]
    before, after = run(student, input=held)[0], run(model, input=held)[0]
    assert discrepancy([after], [t])[1] < discrepancy([before], [t])[1]  # in onnxruntime, on the written model


def _kl(teacher: np.ndarray, student: np.ndarray) -> float:
    """Mean KL(softmax(teacher) || softmax(student)) over the rows, in float64 numpy."""
    lt, ls = (a - np.logaddexp.reduce(a, axis=1, keepdims=True) for a in (teacher.astype(float), student.astype(float)))
    return float((np.exp(lt) * (lt - ls)).sum(axis=1).mean())


def test_written_model_is_judged_in_onnxruntime_on_unpicked_samples(tiny, student) -> None:
    """The report's verdict is the written model's KL to the teacher in onnxruntime, on held-out samples
    that picked no checkpoint; beside it, the same on the training samples."""
    model, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast_for("block")))
    pick, verdict = halves(split(len(tiny.x), 0.2)[1])
    assert (report.samples_held, report.samples_verdict) == (len(pick) + len(verdict), len(verdict))
    assert not set(pick) & set(verdict) and len(verdict) >= 2
    x = tiny.x[verdict]
    (teacher,) = run(tiny.model, input=x)
    assert report.before == pytest.approx(_kl(teacher, run(student, input=x)[0]), rel=1e-6)
    assert report.after == pytest.approx(_kl(teacher, run(model, input=x)[0]), rel=1e-6)
    assert report.improved and report.after < report.before
    # and on the samples trained on: what the weights reach where they trained
    x = tiny.x[split(len(tiny.x), 0.2)[0]]
    (teacher,) = run(tiny.model, input=x)
    assert report.train_metric == "kl" and report.samples_train == len(x)
    for given, kl, agreement in ((student, report.train_before, report.train_agreement_before),
                                 (model, report.train_after, report.train_agreement_after)):
        (y,) = run(given, input=x)
        assert kl == pytest.approx(_kl(teacher, y), rel=1e-6)
        assert agreement == pytest.approx(float((y.argmax(1) == teacher.argmax(1)).mean()))
    assert report.train_after < report.train_before


def test_a_broken_write_back_is_refused(tiny, student, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights that do not reach the written model: recover raises, naming the error and the tolerance."""
    monkeypatch.setattr(onnxprune.recovery.stages, "write_back", lambda model, net: model)
    with pytest.raises(OnnxPruneError, match=r"differs from the trained weights by \S+ .* tolerance 1e-04"):
        recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast_for("block")))


@pytest.mark.parametrize("segments", [1, 0])
def test_distill_trains_the_head_on_cached_views_or_the_whole_model(tiny, student, segments: int) -> None:
    """distill_segments=k trains the last k segments on distill_views cached views of every training
    sample; 0 trains every weight on batches augmented on the fly."""
    options = RecoverOptions(**fast_for("distill"), distill_segments=segments, distill_views=3)
    model, report = recover(student, tiny.model, _calib(tiny), options)
    last = find_segments(import_graph(student), import_graph(tiny.model))[-1]
    d = report.distill
    assert report.improved and d.held_after < d.held_before
    assert d.whole_model == (segments == 0)
    if segments:
        assert d.trained_from == last.start
        assert d.samples == 3 * report.samples_train
        total = sum(int(np.prod(t.dims)) for t in student.graph.initializer if t.data_type == onnx.TensorProto.FLOAT)
        assert 0 < d.parameters < total / 2
    else:
        assert d.trained_from == [i.name for i in student.graph.input]
        assert d.samples == FAST["distill_steps"] * FAST["batch_size"]
    assert report.writeback_error <= 1e-5


@pytest.mark.parametrize("segments", [1, 0])
def test_a_softened_distillation_still_chooses_its_checkpoints_on_the_plain_kl(tiny, student, segments: int) -> None:
    """With a temperature the distillation trains on ``softened_kl`` (other weights than at T = 1), while its
    held-out measures, which choose the checkpoint, stay the plain KL a user's agreement follows."""
    fast = {**fast_for("distill"), "distill_segments": segments}
    plain, softened = (recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast, temperature=t))[1].distill
                       for t in (1.0, 2.0))
    assert softened.held_before == pytest.approx(plain.held_before, rel=1e-9)
    assert softened.held_after < softened.held_before and softened.held_after != plain.held_after


@pytest.mark.parametrize("seconds, samples", [(None, 4 * 40), (1e-9, 16), (1e9, 4 * 40)])
def test_the_head_caches_as_many_views_as_its_time_allows(tiny, student, seconds: float | None, samples: int) -> None:
    """Without a time, every view asked for; where the next view would end past the time, no more, and the first
    one only over as many batches as its first batch's time says fit (one batch of 16 at least): the views are
    work before the training, which a short ``--time`` overran (YOLOv8s at 640²: one view took 2 of `--time 1m`'s
    minutes)."""
    from onnxprune.recovery.stages import _augmenter, _head_views

    options = RecoverOptions(**FAST, distill_views=4)
    start = find_segments(import_graph(student), import_graph(tiny.model))[-2].start
    name = student.graph.input[0].name
    held = run(tiny.model, **{name: tiny.x[40:]})
    xs, ts, n = _head_views(student, import_graph(tiny.model), start, {name: tiny.x}, np.arange(40), np.arange(40, 64),
                            held, _augmenter(student, options)[1], options, options.store(), seconds)
    assert n == samples and len(xs[0]) == len(ts[0]) == n + 24


@pytest.mark.parametrize("lr", [0.0, 50.0])
def test_never_worse_returns_the_input(tiny, student, lr: float) -> None:
    """No training (lr 0) or destructive training (lr 50): the held-out check hands back the input."""
    options = RecoverOptions(**{**FAST, "lr": lr, "distill_lr": lr})
    model, report = recover(student, tiny.model, _calib(tiny), options)
    assert not report.improved
    assert model is student
    assert all(s.best_step == 0 for s in report.segments)
    assert report.distill.best_step == 0


def test_the_report_says_how_sure_the_verdict_is(tiny, student, capsys) -> None:
    """The share of the verdict samples' resamples on which the recovered weights score better: none where nothing
    trained (lr 0), most but not all where 100 steps of whole-model distillation lower the KL on the 6 samples by a
    little; printed with the verdict."""
    from onnxprune.tables import print_recovery

    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**{**FAST, "lr": 0.0, "distill_lr": 0.0}))
    assert not report.improved and report.confidence == 0.0
    options = RecoverOptions(**fast_for("distill"), distill_segments=0)
    model, report = recover(student, tiny.model, _calib(tiny), options)
    assert report.improved and model is not student and 0.5 < report.confidence < 1.0
    print_recovery(report)
    out = " ".join(capsys.readouterr().out.split())
    assert f"kept the recovered weights (better on {report.confidence:.0%} of 1000 resamples of those samples" in out


def test_held_out_samples_given_apart(tiny, student) -> None:
    """``held``: every calibration sample trains, the given ones choose checkpoints and judge."""
    name = tiny.model.graph.input[0].name
    calib = ArraySet({name: tiny.x}, np.arange(48), {name: np.dtype(np.float32)})
    held = ArraySet({name: tiny.x}, np.arange(48, 64), {name: np.dtype(np.float32)})
    options = RecoverOptions(**{**fast_for("block"), "steps": 20})
    _, report = recover(student, tiny.model, calib, options, held=held)
    assert (report.samples_train, report.samples_held, report.held_unseen) == (48, 16, True)
    wrong = ArraySet({"other": tiny.x}, np.arange(4), {"other": np.dtype(np.float32)})
    with pytest.raises(CalibrationError, match="held-out samples feed"):
        recover(student, tiny.model, calib, options, held=wrong)


def _dim_yolo(tmp_path) -> tuple[onnx.ModelProto, onnx.ModelProto, ArraySet]:
    """The tiny YOLO (``models.yolo``) with its class scores lowered by 20: it finds objects on bright images
    (values up to 4) and none on dim ones (up to 1); the teacher, it pruned to 0.7 (local, uniform, no refit), and
    40 images, every third bright."""
    from onnx import numpy_helper

    from models.build import randomise
    from models.yolo import Detector

    shape = (1, 3, 64, 64)
    model = onnx.load(export_torch(randomise(Detector(classes=2, w=4), input_shape=shape), tmp_path / "y.onnx", shape))
    weights = {w.name: w for w in model.graph.initializer}
    for node in model.graph.node:  # the class branches' last convs: 2 output channels
        if node.op_type == "Conv" and len(node.input) == 3 and list(weights[node.input[2]].dims) == [2]:
            bias = weights[node.input[2]]
            bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) - 20, bias.name))
    x = np.random.default_rng(0).random((40, *shape[1:]), dtype=np.float32)
    x[::3] *= 4
    calib = ArraySet({"input": x}, np.arange(40), {"input": np.dtype(np.float32)})
    student = compress(model, calib, options_from(Ratio(0.7), Local(), Uniform(), NoRefit(), provider="cpu"))[0]
    return model, student, calib


def test_a_detectors_report_counts_the_verdicts_samples_with_objects(tmp_path, capsys) -> None:
    """Every third sample shows an object: 3 of the 8 held out (every fifth) and 2 of the 4 of them that judge, as
    the report and the printed note say (the verdict's share is what never-worse rests on)."""
    from onnxprune.tables import print_recovery

    teacher, student, calib = _dim_yolo(tmp_path)
    _, report = recover(student, teacher, calib, RecoverOptions(method="block", steps=1, batch_size=16,
                                                                 provider="cpu"))
    assert (report.samples_train, report.with_objects, report.verdict_with_objects) == (32, 3, 2)
    print_recovery(report)
    assert "finds objects in 3 of the 8 held-out samples (2 of them among the 4 that judge)" in " ".join(
        capsys.readouterr().out.split())


def test_a_detector_tied_on_its_verdict_samples_is_judged_there_by_its_objective(tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    """Where the verdict samples give both models the same mAP50-95, the objective on those samples decides: lower
    after training keeps the recovered weights (and says so); a tie there too returns the input."""
    import onnxprune.recovery.run as run_module
    from onnxprune.tables import print_recovery

    teacher, student, calib = _dim_yolo(tmp_path)
    options = RecoverOptions(method="distill", distill_steps=30, distill_lr=1e-3, distill_views=1, batch_size=16,
                             provider="cpu")
    monkeypatch.setattr(run_module, "discrepancy", lambda *args: ("1-mAP50-95", 0.0, None))
    model, report = recover(student, teacher, calib, options)
    assert report.improved and model is not student
    assert report.tie_objective is not None and report.tie_objective[1] < report.tie_objective[0]
    print_recovery(report)
    assert "1-mAP50-95 tied, so the objective decided there" in " ".join(capsys.readouterr().out.split())
    monkeypatch.setattr(run_module, "scores", lambda *args: lambda pick: 0.0)  # the objective tied as well
    model, report = recover(student, teacher, calib, options)
    assert not report.improved and model is student and report.tie_objective == (0.0, 0.0)


def test_bad_inputs(tiny, zoo, student) -> None:
    with pytest.raises(ModelError, match="outputs|inputs"):
        recover(student, zoo.model("mobilenet_v2"), _calib(tiny), RecoverOptions(**FAST))
    with pytest.raises(ModelError, match="nothing to recover"):
        recover(tiny.model, tiny.model, _calib(tiny), RecoverOptions(**FAST))
    renamed = onnx.ModelProto()
    renamed.CopyFrom(student)
    renamed.graph.node[3].name = "not_from_the_teacher"
    with pytest.raises(ModelError, match="not in the teacher"):
        recover(renamed, tiny.model, _calib(tiny), RecoverOptions(**FAST))
    with pytest.raises(CalibrationError, match="too few"):
        recover(student, tiny.model, _calib(tiny, 4), RecoverOptions(**FAST))
    with pytest.raises(CalibrationError, match="empty"):
        recover(student, tiny.model, _calib(tiny, 0), RecoverOptions(**FAST))
    with pytest.raises(ValueError, match="method"):
        recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast_for("finetune")))
    for bad, words in (({"distill_views": 0}, "distill_views 0 must be at least 1"),
                       ({"distill_segments": -1}, "distill_segments -1 must be at least 0"),
                       ({"colour": 1.0}, r"colour 1.0 must be in \[0, 1\)"),
                       ({"leaves": 1.5}, r"leaves 1.5 must be a share of the images in \[0, 1\]"),
                       ({"steer": -0.1}, r"steer -0.1 must be a share of the images in \[0, 1\]"),
                       ({"whole_share": 0.0}, r"whole_share 0.0 must be a share of the time in \(0, 1\)"),
                       ({"average": 1.0}, r"average 1.0 must be in \[0, 1\)"),
                       ({"temperature": 0.0}, "temperature 0.0 must be positive")):
        with pytest.raises(ValueError, match=words):  # when the options are built, before any work
            RecoverOptions(**FAST, **bad)


@pytest.mark.parametrize("segments", [0, 2])
def test_recovery_does_not_depend_on_the_memory_budget(tiny, student, segments: int, tmp_path) -> None:
    """Every cached tensor spilled (budget 0: the samples, the teacher's and student's segment tensors, the
    head's augmented views, given held-out samples) or all in RAM: the same recovered model, bit for bit, and
    nothing left in the spill folder."""
    name = tiny.model.graph.input[0].name
    calib = ArraySet({name: tiny.x}, np.arange(48), {name: np.dtype(np.float32)})
    held = ArraySet({name: tiny.x}, np.arange(48, 64), {name: np.dtype(np.float32)})
    fast = {**FAST, "distill_segments": segments, "distill_views": 2}
    weights = lambda m: {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}  # noqa: E731
    in_ram, report = recover(student, tiny.model, calib, RecoverOptions(**fast, memory=2**40), held=held)
    spilled, _ = recover(student, tiny.model, calib, RecoverOptions(**fast, memory=0, spill_dir=str(tmp_path)),
                         held=held)
    assert report.improved and weights(spilled) == weights(in_ram)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OptionError, match="memory=-2"):
        RecoverOptions(memory=-2)


@pytest.mark.parametrize("loss", ["kl", "rel_mse"])
def test_held_loss_accumulated_by_batch_equals_the_loss_on_all_samples(loss: str) -> None:
    """The held-out loss never holds all the held-out outputs: batch sums (KL of the rows; squared error and the
    targets' first two moments) give the loss of the whole set."""
    import torch

    from onnxprune.recovery.train import held_loss, kl_loss, relative_mse

    class Outputs(torch.nn.Module):  # the "net" returns its inputs: ys = xs
        def forward(self, *xs: torch.Tensor) -> list[torch.Tensor]:
            return list(xs)

    rng = np.random.default_rng(0)
    shapes = [(40, 10)] if loss == "kl" else [(40, 3, 4), (40, 5)]
    ys = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ts = [(y + 0.3 * rng.standard_normal(y.shape) + 1.0).astype(np.float32) for y in ys]
    idx = np.sort(rng.choice(40, 23, replace=False))
    fn = kl_loss if loss == "kl" else relative_mse
    whole = float(fn([torch.from_numpy(y[idx]).double() for y in ys], [torch.from_numpy(t[idx]).double() for t in ts]))
    assert held_loss(Outputs(), ys, ts, idx, 5, fn) == pytest.approx(whole, rel=1e-9)


def test_kl_reads_a_softmax_output_as_probabilities() -> None:
    """A model that ends in Softmax outputs probabilities: the distillation's KL and the verdict's are those of the
    probabilities themselves (as for the logits before the Softmax), not of a second softmax over them."""
    import torch

    from onnxprune.recovery.train import kl_loss

    rng = np.random.default_rng(0)
    t, y = (torch.from_numpy(3 * rng.standard_normal((16, 10))) for _ in range(2))
    on_logits = float(kl_loss([y], [t]))
    assert on_logits > 0.1
    assert float(kl_loss([torch.softmax(y, 1)], [torch.softmax(t, 1)])) == pytest.approx(on_logits, rel=1e-6)
    metric, value, _ = discrepancy([torch.softmax(y, 1).numpy()], [torch.softmax(t, 1).numpy()])
    assert metric == "kl" and value == pytest.approx(on_logits, rel=1e-6)


def test_the_softened_kl_is_the_kl_of_the_rows_divided_by_the_temperature_times_its_square() -> None:
    """T²·KL(softmax(t/T) || softmax(y/T)), of logits or of probabilities alike; far above the logits' spread it is
    half the variance of their difference over the classes (logit matching), so the classes the teacher gives no
    mass still pull; T = 1 is ``kl_loss`` itself."""
    import torch

    from onnxprune.recovery.train import kl_loss, softened_kl

    rng = np.random.default_rng(1)
    t, y = (torch.from_numpy(3 * rng.standard_normal((16, 10))) for _ in range(2))
    assert softened_kl(1.0) is kl_loss
    want = 16 * float(kl_loss([y / 4], [t / 4]))
    assert float(softened_kl(4.0)([y], [t])) == pytest.approx(want, rel=1e-6)
    assert float(softened_kl(4.0)([torch.softmax(y, 1)], [torch.softmax(t, 1)])) == pytest.approx(want, rel=1e-6)
    d = t - y
    half_variance = float(((d - d.mean(1, keepdim=True)) ** 2).mean(1).mean()) / 2
    assert float(softened_kl(1e3)([y], [t])) == pytest.approx(half_variance, rel=1e-2)
    assert abs(float(kl_loss([y], [t])) - half_variance) > 0.1 * half_variance


@pytest.mark.parametrize("option, message", [({"temperature": 2.0}, "temperature 2.0 softens a classifier's"),
                                             ({"pool": 2}, "pool 2 chooses a classifier's inputs"),
                                             ({"steer": 0.5}, "steer 0.5 moves a classifier's inputs")])
def test_a_classifiers_option_is_refused_for_a_model_that_is_not_a_classifier(tmp_path, option, message) -> None:
    """Softening probabilities, or choosing inputs by their KL, means nothing to a detector's boxes: refused by name
    before any training, not ignored."""
    teacher, student, calib = _dim_yolo(tmp_path)
    with pytest.raises(OptionError, match=message):
        recover(student, teacher, calib, RecoverOptions(steps=1, distill_steps=1, batch_size=16, provider="cpu",
                                                        **option))


@pytest.mark.parametrize("method, option", [("block", {"temperature": 2.0}), ("block", {"mix": "cutmix"}),
                                            ("block", {"pool": 2}), ("distill", {"block_window": 2}),
                                            ("distill", {"steps": 5}), ("distill", {"steps": 200}),
                                            ("block", {"distill_steps": 600})])
def test_a_flag_of_the_stage_a_method_leaves_out_is_refused_by_name(method, option) -> None:
    """``--temperature`` with ``--method block`` would change nothing: refused, naming the option, not ignored (a
    step count equal to the one a run bounded by steps uses included); the same options at their defaults pass."""
    name = next(iter(option))
    with pytest.raises(OptionError, match=f"{name} set, and method '{method}' runs no ") as caught:
        RecoverOptions(method=method, **option)
    assert caught.value.option == name
    default = next(f.default for f in dataclasses.fields(RecoverOptions) if f.name == name)
    assert RecoverOptions(method=method, **{name: default}).method == method


def test_the_hardest_rows_are_those_with_the_largest_kl() -> None:
    """``hardest`` ranks the rows by KL(t || y): rows where the student already agrees are left out."""
    import torch

    from onnxprune.recovery.train import hardest, row_kl

    rng = np.random.default_rng(2)
    t = torch.from_numpy(rng.standard_normal((8, 5)))
    y = t.clone()
    y[[1, 4, 6]] += torch.from_numpy(np.array([[3.0, 0, 0, 0, 0], [0, 0, 1.0, 0, 0], [0, 0, 0, 0, 2.0]]))
    kl = row_kl(y, t)
    assert list(hardest(y, t, 2)) == sorted([1, 4, 6], key=lambda i: -float(kl[i]))[:2]
    assert len(hardest(y, t, 20)) == 8


@pytest.mark.parametrize("segments", [0, 1])
def test_a_pooled_distillation_trains_on_the_inputs_the_student_gets_most_wrong(tiny, student, segments,
                                                                               monkeypatch) -> None:
    """With ``pool`` 3 each batch is drawn three times as large and cut to the batch size by ``hardest`` (on the
    head's cached views and on the whole model's augmented batches alike); which rows ``hardest`` keeps is its own
    test's."""
    from onnxprune.recovery import train

    chosen = []
    real = train.hardest

    def spy(ys, ts, keep):
        chosen.append((len(ys), keep))
        return real(ys, ts, keep)

    monkeypatch.setattr(train, "hardest", spy)
    fast = {**fast_for("distill"), "distill_segments": segments, "distill_steps": 5}
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast, pool=3))
    assert chosen and all(keep == 16 and n == 48 for n, keep in chosen)
    assert report.options["pool"] == 3


def test_a_steered_distillation_moves_its_batches_on_the_teacher(tiny, student, monkeypatch) -> None:
    """With ``steer`` the whole model's distillation hands every augmented batch, its share and the teacher's logits
    to ``augment.steer`` (which moves them: its own test's) and trains on what it returns; the report says so. A head
    distillation has no input to move: refused by name before any training."""
    from onnxprune.recovery import stages

    seen = []
    real = stages.steer

    def spy(x, logits, gen, share):
        seen.append((tuple(x.shape), share, tuple(logits(x).shape)))
        return real(x, logits, gen, share)

    monkeypatch.setattr(stages, "steer", spy)
    fast = {**fast_for("distill"), "distill_segments": 0, "distill_steps": 5}
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast, steer=0.5))
    assert seen and all(shape == (16, 3, 32, 32) and share == 0.5 and out == (16, 10) for shape, share, out in seen)
    assert "50% steered to random classes" in report.distill.augment
    with pytest.raises(OptionError, match=r"steer 0.5 moves the one float input of a whole-model distillation, and "
                                          r"this run distils the last 2 segments \(as asked\)"):
        recover(student, tiny.model, _calib(tiny), RecoverOptions(**{**fast, "distill_segments": 2}, steer=0.5))


def test_steering_needs_the_one_float_input_of_a_whole_model_distillation() -> None:
    """Token ids, several inputs or a head's tensors give ``steer`` nothing to move: refused, saying which and the
    way out; one float input of a whole-model distillation passes."""
    from onnxprune.recovery.run import _steerable

    x = np.zeros((2, 3), np.float32)
    _steerable(0.5, 0, "the whole model", {"x": x})
    for part, values, words in ((0, {"ids": x.astype(np.int64)}, "its input 'ids' holds int64: leave it at 0$"),
                                (0, {"a": x, "b": x}, r"the model takes 2 inputs \(a, b\): leave it at 0$"),
                                (1, {"x": x}, r"the last 1 segment \(as asked\): leave it at 0, or give "
                                              "--distill-segments 0")):
        with pytest.raises(OptionError, match=words):
            _steerable(0.5, part, "as asked", values)


def test_recovers_a_model_whose_matmul_head_the_refit_gave_a_bias() -> None:
    """A MatMul has no bias input: the refit of a MatMul consumer writes its bias in an ``Add`` after it, a node
    the teacher does not have. Recovery takes it as the pruning's own (it refused the model before). The model
    ends in weightless segments (Identity, Softmax): the distilled head reaches back to the MatMul's (it had
    nothing to train before)."""
    from tests.onnx_builders import GraphBuilder

    b = GraphBuilder({"x": ["N", 3, 8, 8]})
    h = b.op("Relu", [b.conv("x", "c1", 3, 16)], "r1")
    h = b.op("Relu", [b.conv(h, "c2", 16, 16)], "r2")
    pooled = b.op("Flatten", [b.op("GlobalAveragePool", [h], "gap")], "flat")
    logits = b.op("Identity", [b.matmul(pooled, "head", 16, 5)], "same")
    teacher = b.model([b.op("Softmax", [logits], "probs", axis=1)])
    x = np.random.default_rng(0).standard_normal((48, 3, 8, 8)).astype(np.float32)
    data = ArraySet({"x": x}, np.arange(48), {"x": np.dtype(np.float32)})
    student = compress(teacher, data, options_from(Ratio(0.6), provider="cpu", round_to=1))[0]
    assert "head.bias_add" in {n.name for n in student.graph.node}
    segments = find_segments(import_graph(student), import_graph(teacher))
    assert any("head.bias" in s.changed for s in segments)
    assert [s.nodes for s in segments[-2:]] == [["same"], ["probs"]] and not segments[-1].weights
    first = head_start(segments, 2, changed_only=False)
    assert first == len(segments) - 3 and "head.bias" in segments[first].weights
    _, report = recover(student, teacher, data, RecoverOptions(**FAST))
    assert report.distill.parameters > 0 and report.after <= report.before


def test_windows_join_runs_of_changed_segments() -> None:
    """Every run of k changed segments, with the unchanged ones between them, becomes one from the first's start to
    the last's end; what follows the last changed segment stays as it was."""
    seg = lambda name, changed: Segment([name + "_in"], [name + "_out"], [name], [name] * changed, [name])  # noqa: E731
    segments = [seg("a", 1), seg("b", 0), seg("c", 1), seg("d", 1), seg("e", 0), seg("f", 0)]
    two = windows(segments, 2)
    assert [w.nodes for w in two] == [["a", "b", "c"], ["d"], ["e"], ["f"]]
    assert (two[0].start, two[0].end) == (["a_in"], ["c_out"])
    assert (two[0].changed, two[0].weights) == (["a", "c"], ["a", "b", "c"])
    assert two[1:] == segments[3:]
    assert windows(segments, 1) == segments
    assert [w.nodes for w in windows(segments, 5)] == [["a", "b", "c", "d"], ["e"], ["f"]]


def test_the_block_stage_trains_a_window_of_segments_together(tiny, student) -> None:
    """block_window=2: the three changed segments of the tiny model train as two, each to the teacher's tensor at its
    last segment's end, and the model still improves and is written back exactly."""
    changed = [s.end for s in find_segments(import_graph(student), import_graph(tiny.model)) if s.trainable]
    assert len(changed) == 3
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**fast_for("block"), block_window=2))
    assert [s.end for s in report.segments] == [changed[1], changed[2]]
    assert report.improved and report.writeback_error <= 1e-5
    with pytest.raises(OptionError, match="block_window 0 must be at least 1"):
        RecoverOptions(block_window=0)


def test_head_start_reaches_back_to_weights() -> None:
    seg = lambda weights, changed=(): Segment([], [], [], list(changed), list(weights))  # noqa: E731
    segments = [seg(["a"], ["a"]), seg(["b"]), seg([]), seg([])]
    assert head_start(segments, 2, changed_only=False) == 1  # the last two hold no weight: back to b
    assert head_start(segments, 2, changed_only=True) == 0  # b's weights are the teacher's: back to a
    assert head_start(segments, 3, changed_only=False) == 1
    assert head_start([seg(["a"]), seg(["b"]), seg(["c"])], 1, changed_only=False) == 2  # as before: the last one
    assert head_start(segments, 0, changed_only=False) is None and head_start(segments, 4, changed_only=False) is None


def test_the_block_stage_leaves_a_head_that_is_one_changed_segment_to_the_distillation() -> None:
    from onnxprune.recovery.stages import left_to_distill

    seg = lambda weights, changed=(): Segment([], [], [], list(changed), list(weights))  # noqa: E731
    # YOLOv8n: the backbone's early blocks, then neck and head in one segment, then the unchanged DFL decoding
    detector = [seg(["a"], ["a"]), seg(["b"]), seg(["c"], ["c"]), seg(["dfl"])]
    classifier = [seg(["a"], ["a"]), seg(["b"], ["b"]), seg(["c"], ["c"])]
    options = RecoverOptions(distill_segments=HEAD_SEGMENTS)  # what a detector's run resolves the default to
    assert left_to_distill(detector, options) == 2
    assert left_to_distill(detector[:3], options) is None  # a head of two segments starts before the changed one
    assert left_to_distill(classifier, options) is None  # the head's two changed segments: block-wise first
    assert left_to_distill(detector, RecoverOptions(method="block")) is None
    assert left_to_distill(detector, RecoverOptions(distill_segments=0)) is None  # whole model: blocks first
    from onnxprune.recovery.stages import block_plan

    head_only = [seg(["a"]), seg(["b"]), seg(["c"], ["c"]), seg(["dfl"])]  # pruning changed the head alone
    assert block_plan(head_only, options)[1:] == (2, []) and block_plan(detector, options)[2] == [0]


def test_a_block_stage_with_nothing_to_train_is_not_run(tiny, student, monkeypatch) -> None:
    """Where every changed segment is left to the distillation, the block stage would only pass every sample
    through both models (YOLOv8s at 640²: five minutes of a one-minute budget, for nothing): it does not run."""
    import onnxprune.recovery.run as run_module

    def no_blocks(segments, options):
        return segments, None, []

    def never(*args, **kwargs):
        raise AssertionError("the block stage ran")

    monkeypatch.setattr(run_module, "block_plan", no_blocks)
    monkeypatch.setattr(run_module, "block_stage", never)
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(time=3.0, provider="cpu"))
    assert not report.segments and report.distill is not None and report.writeback_error <= 1e-4


def test_a_time_budget_runs_each_loop_for_its_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``seconds`` the loop runs until its time is spent (a clock that ticks one second a call here), checks
    the held-out loss at each fifth of the time and keeps the best weights; the cosine follows the time."""
    import onnxprune.recovery.train as train

    ticks = iter(range(1000))
    monkeypatch.setattr(train.time, "monotonic", lambda: float(next(ticks)))
    w = torch.nn.Parameter(torch.tensor([4.0]))
    helds = []

    def held() -> float:
        helds.append(float(w.detach()[0] ** 2))
        return helds[-1]

    result = train.train_loop([w], lambda gen: (w**2).sum(), held, steps=10_000, lr=0.1, pull=0.0, seed=0,
                              seconds=20.0)
    assert 0 < result.steps < 20 and len(helds) == 1 + 5  # the start, then one per fifth of the time
    assert result.held_after == min(helds) < helds[0] and float(w.detach()[0] ** 2) == result.held_after


def test_the_learning_rate_is_chosen_by_short_trials_from_the_same_start() -> None:
    """Given candidate rates, each trains ``LR_TRIAL`` of the steps from the same weights, the one leaving the lowest
    held-out loss trains the rest from where its trial ended: on w² from w = 4, Adam at 1 gets near 0 in 5 steps,
    1e-3 barely moves, 20 overshoots."""
    import onnxprune.recovery.train as train

    def run(lr):
        w = torch.nn.Parameter(torch.tensor([4.0]))
        helds = []

        def held() -> float:
            helds.append(float(w.detach()[0] ** 2))
            return helds[-1]

        return train.train_loop([w], lambda gen: (w**2).sum(), held, steps=100, lr=lr, pull=0.0, seed=0), helds

    result, helds = run((20.0, 1.0, 1e-3))
    assert [lr for lr, _ in result.trials] == [20.0, 1.0, 1e-3] and result.lr == 1.0
    assert result.trials[1][1] < 1.0 < min(result.trials[0][1], result.trials[2][1])
    assert helds[1:4] == [held for _, held in result.trials]  # measured once each, after the start
    assert result.held_before == 16.0 and result.steps == 100
    alone, _ = run((1.0,))
    assert alone.trials == result.trials[1:2]  # the start was restored after the trial at 20



def test_rates_are_tried_no_longer_than_the_trials_overrun_their_time(monkeypatch) -> None:
    """Under seconds, a trial whose held-out measure alone takes ten times the trial's time ends the trials (the
    first, gentlest rate is the one kept): a detector's head at 640² spent 135 s of a one-minute budget on four."""
    import onnxprune.recovery.train as train

    now = [0.0]
    monkeypatch.setattr(train.time, "monotonic", lambda: now[0])
    w = torch.nn.Parameter(torch.tensor([4.0]))

    def held() -> float:
        now[0] += 30.0  # a slow held-out measure: 30 s each
        return float(w.detach()[0] ** 2)

    def loss(gen):
        now[0] += 0.01
        return (w**2).sum()

    trials, chosen, _ = train.choose_lr([w], loss, held, (1e-3, 1.0, 20.0), [w.detach().clone()], steps=5,
                                        seconds=0.1, pull=0.0, seed=0)
    assert [lr for lr, _ in trials] == [1e-3] and chosen == 1e-3
    trials, _, _ = train.choose_lr([w], loss, held, (1e-3, 1.0, 20.0), [w.detach().clone()], steps=5,
                                   seconds=10.0, pull=0.0, seed=0)
    assert [lr for lr, _ in trials] == [1e-3, 1.0, 20.0]  # trials within their time try every rate

    def quick_held() -> float:
        now[0] += 5.0  # fifty times a trial's 0.1 s, but under TRIALS_FLOOR in all: nothing a user waits for
        return float(w.detach()[0] ** 2)

    trials, _, _ = train.choose_lr([w], loss, quick_held, (1e-3, 1.0), [w.detach().clone()], steps=5, seconds=0.1,
                                   pull=0.0, seed=0)
    assert [lr for lr, _ in trials] == [1e-3, 1.0]


def test_the_loop_goes_on_from_the_winning_trial_whose_weights_are_no_checkpoint() -> None:
    """The loop's first step starts where the winning trial ended, each trial from the start; the trial's own
    weights are not kept (their held-out loss is the least of several, biased low): training on w² from 4 while the
    held-out loss is (w - 3.5)², the trial at 0.1 ends near 3.5, the loop goes past it, and the start is kept."""
    import onnxprune.recovery.train as train

    w = torch.nn.Parameter(torch.tensor([4.0]))
    seen = []

    def batch_loss(gen: torch.Generator) -> torch.Tensor:
        seen.append(float(w.detach()[0]))
        return (w**2).sum()

    result = train.train_loop([w], batch_loss, lambda: float((w.detach()[0] - 3.5) ** 2), steps=100, lr=(0.1, 1e-3),
                              pull=0.0, seed=0, patience=5)
    assert result.lr == 0.1 and result.trials[0][1] < 0.01 and len(seen) == 5 + 5 + 100
    assert seen[0] == seen[5] == 4.0 and abs(seen[10] - 3.5) < 0.1  # trials from the start, the loop from the winner
    assert result.best_step == 0 and float(w.detach()[0]) == 4.0 and result.held_after == 0.25
    assert not result.stopped


@pytest.mark.parametrize("average", [0.0, 0.8])
def test_the_loop_keeps_the_moving_average_of_its_weights_where_asked(average: float) -> None:
    """With ``average`` the held-out loss is measured on, and the loop keeps, the exponential moving average of the
    weights its steps left (each step's weight 1 - average), replayed here from the steps; without, the last step's."""
    import onnxprune.recovery.train as train

    w = torch.nn.Parameter(torch.tensor([4.0]))
    after, measured = [], []

    def held() -> float:
        measured.append(float(w.detach()[0]))
        return -abs(measured[-1] - 4.0)  # the further from the start, the better: the end is kept

    result = train.train_loop([w], lambda gen: (w**2).sum(), held, steps=10, lr=0.1, pull=0.0, seed=0, evals=1,
                              on_step=lambda k, value, best: after.append(float(w.detach()[0])), average=average)
    mean = 4.0
    for x in after:
        mean = average * mean + (1 - average) * x
    want = after[-1] if average == 0 else mean
    assert result.best_step == 10 and len(after) == 10
    assert measured[-1] == pytest.approx(want) and float(w.detach()[0]) == pytest.approx(want)
    assert (want > after[-1] + 0.1) == (average > 0)  # the average lags behind the steps


@pytest.mark.parametrize("seconds", [None, 20.0])
def test_a_loop_that_never_beats_its_start_stops_at_its_patience(monkeypatch, seconds) -> None:
    """Training away from the held-out optimum (w² from 4 while held-out is (w - 4)²), no measure beats the start:
    the loop ends at its third of five measures (steps, or a clock ticking one second a call), the start kept; one
    that gains at its first measure runs to the end."""
    import onnxprune.recovery.train as train

    ticks = iter(range(10_000))
    monkeypatch.setattr(train.time, "monotonic", lambda: float(next(ticks)))

    def run(target: float) -> tuple[train.FitResult, list[float]]:
        w = torch.nn.Parameter(torch.tensor([4.0]))
        helds: list[float] = []

        def held() -> float:
            helds.append(float((w.detach()[0] - target) ** 2))
            return helds[-1]

        result = train.train_loop([w], lambda gen: (w**2).sum(), held, steps=100, lr=0.1, pull=0.0, seed=0,
                                  seconds=seconds)
        return result, helds

    stuck, helds = run(4.0)
    assert stuck.stopped and stuck.best_step == 0 and len(helds) == 1 + train.PATIENCE
    assert seconds is not None or stuck.steps == 60
    gaining, helds = run(0.0)
    assert not gaining.stopped and len(helds) == 1 + 5 and gaining.best_step > 0


@pytest.mark.parametrize("seconds", [None, 20.0])
def test_a_loop_whose_every_rate_trial_loses_to_its_start_ends_after_the_trials(monkeypatch, seconds) -> None:
    """Training away from the held-out optimum at every candidate rate: the loop ends after its trials (their
    steps alone), the start kept; one trial that beats the start lets the loop run."""
    import onnxprune.recovery.train as train

    ticks = iter(range(10_000))
    monkeypatch.setattr(train.time, "monotonic", lambda: float(next(ticks)))

    def run(target: float) -> tuple[train.FitResult, int]:
        w = torch.nn.Parameter(torch.tensor([4.0]))
        steps = []

        def batch_loss(gen: torch.Generator) -> torch.Tensor:
            steps.append(1)
            return (w**2).sum()

        result = train.train_loop([w], batch_loss, lambda: float((w.detach()[0] - target) ** 2), steps=100,
                                  lr=(1e-3, 0.1), pull=0.0, seed=0, seconds=seconds)
        assert result.stopped or float(w.detach()[0]) != 4.0
        return result, len(steps)

    stuck, steps = run(4.0)
    assert stuck.stopped and stuck.best_step == 0 and stuck.steps == 0 and len(stuck.trials) == 2
    assert stuck.held_after == stuck.held_before == 0.0
    assert steps == 10 if seconds is None else 2 <= steps <= 10  # the trials' steps: 5 a rate, or 1 s each
    gaining, more = run(0.0)
    assert not gaining.stopped and more > steps


def test_recover_keeps_to_its_time(tiny, student) -> None:
    """A recovery given a time runs its loops by the clock (and says so in its options); the distillation's rate
    is the best of its trials."""
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(time=3.0, provider="cpu"))
    assert report.options["time"] == 3.0 and report.segments and report.distill is not None
    trials = report.distill.lr_trials
    assert [lr for lr, _ in trials] == list(DISTILL_LRS) and report.distill.lr == min(trials, key=lambda t: t[1])[0]
    with pytest.raises(OptionError, match="time -1 must be a positive number of seconds"):
        RecoverOptions(time=-1)


@pytest.mark.parametrize(("window", "share"), [(3, 1 / 2), (1, 3 / 4)])
def test_each_loop_gets_an_equal_share_of_the_time(tiny, student, monkeypatch: pytest.MonkeyPatch, window: int,
                                                   share: float) -> None:
    """Under a time, the block stage's loops (one window of the tiny model's three changed segments, or three) get
    as much of what is left each as the distillation's one loop after them, not a fixed share; the head's views are
    cached within a quarter of the distillation's time first."""
    from onnxprune.recovery.options import VIEWS_SHARE, Clock

    shares: list[float] = []
    real = Clock.loop
    monkeypatch.setattr(Clock, "loop", lambda self, share=1.0: shares.append(share) or real(self, share))
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(time=3.0, provider="cpu",
                                                                         block_window=window,
                                                                         distill_segments=HEAD_SEGMENTS))
    rounds = max(seg.round for seg in report.segments)  # a distillation that stopped early leaves another round
    # the block stage, the views, the distillation: all that is left; each later round of the windows: all of it
    assert shares == [share, VIEWS_SHARE, 1.0] + [1.0] * (rounds - 1)


@pytest.mark.parametrize("whole_share", [None, 0.25])
def test_a_whole_network_distillation_gets_its_share_of_the_time_after_the_block_stage(tiny, student, monkeypatch,
                                                                                      whole_share) -> None:
    """Before a distillation of every weight (``distill_segments=0``), the block stage gets 1 - whole_share
    (WHOLE_SHARE where not given) of the time whatever its loop count, and the distillation what is left: it caches
    no views."""
    from onnxprune.recovery.options import WHOLE_SHARE, Clock

    shares: list[float] = []
    real = Clock.loop
    monkeypatch.setattr(Clock, "loop", lambda self, share=1.0: shares.append(share) or real(self, share))
    given = {} if whole_share is None else {"whole_share": whole_share}
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(time=3.0, provider="cpu",
                                                                         distill_segments=0, **given))
    assert report.distill is not None and report.distill.whole_model
    assert shares[:2] == [1 - (whole_share or WHOLE_SHARE), 1.0]


def test_the_distillation_trains_the_whole_model_of_a_classifier_where_its_steps_fit() -> None:
    """Where --distill-segments is not given: the whole model for a classifier when WHOLE_MIN_STEPS of its steps fit
    in its share of the time (or no time bounds the run), else the head; a detector keeps the head; a given count
    stands. ``recover`` reports the choice and resolves the options to it."""
    from onnxprune.recovery.options import WHOLE_MIN_STEPS, WHOLE_SHARE, WHOLE_STEP_COST, distill_part

    options = RecoverOptions(time=900.0, batch_size=32)
    fits = WHOLE_SHARE * 900.0 / (WHOLE_STEP_COST * 32 * WHOLE_MIN_STEPS)  # the teacher's seconds a sample at the edge
    assert distill_part(options, True, 0.9 * fits)[0] == 0
    part, why = distill_part(options, True, 1.1 * fits)
    assert part == HEAD_SEGMENTS and "fewer than 100" in why
    assert distill_part(options, False, 1e-6) == (HEAD_SEGMENTS, "the head: the whole model's distillation is "
                                                  "measured on classifiers only")
    assert distill_part(RecoverOptions(steps=5), True, 10.0)[0] == 0
    assert distill_part(RecoverOptions(time=900.0, distill_segments=3), True, 1e-6) == (3, "as asked")


def test_recover_reports_what_the_distillation_trains(tiny, student) -> None:
    _, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(**FAST))
    assert report.distill.whole_model and report.options["distill_segments"] == 0
    assert report.distill_choice == "the whole model"


def test_time_left_after_the_stages_goes_to_another_round_of_the_block_windows(tiny, student, monkeypatch) -> None:
    """A distillation that ends early (here cut to a tenth of a second) leaves its time to the block windows, which
    train again from where they were, within the budget; the written model is still checked against them."""
    import onnxprune.recovery.stages as stages

    real = stages.fit

    def quick_distill(*args, seconds=None, **kw):  # only the distillation passes a loss
        return real(*args, seconds=0.1 if "loss" in kw else seconds, **kw)

    monkeypatch.setattr(stages, "fit", quick_distill)
    budget = 8.0  # the distillation's fixed work (its views, one step and a held-out measure per rate) takes ~1 s
    # here, 2.6 s on a loaded machine: at 4 s it sometimes left less than ROUND_SHARE, and no round started
    model, report = recover(student, tiny.model, _calib(tiny), RecoverOptions(time=budget, provider="cpu",
                                                                             distill_segments=HEAD_SEGMENTS))
    rounds = [seg.round for seg in report.segments]
    assert rounds[0] == 1 and max(rounds) >= 2 and rounds == sorted(rounds)
    assert report.improved and report.writeback_error <= 1e-4 and report.seconds < budget * 1.5


def test_progress_names_the_work_before_the_training_loops(tiny, student) -> None:
    """Reading the samples, the block stage's passes and caching the head's views are reported before any training
    step (a detector at 640² spent minutes in each with its bar at the label before), the judging passes after the
    last."""
    labels: list[str] = []
    recover(student, tiny.model, _calib(tiny), RecoverOptions(time=3.0, provider="cpu", distill_segments=HEAD_SEGMENTS),
            on_progress=lambda label, step, total, held: labels.append(label))
    first = [labels.index(next(x for x in labels if x.startswith(p)))
             for p in ("reading the samples", "block stage: the teacher's", "block 1/", "distill: caching", "distill ·",
                       "judging")]
    assert first == sorted(first), labels[:3]
    assert labels[-1].startswith("judging")


def test_another_round_needs_time_left_and_a_round_that_gained() -> None:
    """No budget, less than ROUND_SHARE of it left, or a last round none of whose windows left its start: no round."""
    import time

    from onnxprune.recovery.options import ROUND_SHARE, Clock
    from onnxprune.recovery.report import RecoverReport, SegmentReport
    from onnxprune.recovery.stages import another_round

    def report(*best_steps: tuple[int, int]) -> RecoverReport:
        r = RecoverReport(1, 1, 1, False, "kl", 0.0, 0.0, None, None, False)
        r.segments = [SegmentReport(["y"], 1, 1.0, 1.0, step, 1.0, round=k) for k, step in best_steps]
        return r

    fresh = Clock(100.0)
    assert another_round(fresh, report((1, 5), (1, 0)))
    assert not another_round(fresh, report((1, 5), (2, 0)))  # round 2 gained nothing: no round 3
    assert not another_round(fresh, report())
    assert not another_round(Clock(None), report((1, 5)))
    late = Clock(100.0, start=time.monotonic() - 100.0 * (1 - ROUND_SHARE))
    assert not another_round(late, report((1, 5)))


def test_time_bounds_by_default_and_given_steps_bound_instead() -> None:
    """No bound given: DEFAULT_TIME; steps or distill_steps without a time: the counts (the other one its default);
    a time given wins over steps."""
    from onnxprune.recovery.options import DEFAULT_TIME, DISTILL_STEPS, STEPS

    plain = RecoverOptions()
    assert (plain.time, plain.step_counts()) == (DEFAULT_TIME, (STEPS, DISTILL_STEPS))
    assert (RecoverOptions(steps=5).time, RecoverOptions(steps=5).step_counts()) == (None, (5, DISTILL_STEPS))
    assert (RecoverOptions(distill_steps=7).time, RecoverOptions(distill_steps=7).step_counts()) == (None, (STEPS, 7))
    assert dataclasses.replace(RecoverOptions(steps=5), distill_segments=0).step_counts() == (5, DISTILL_STEPS)
    assert RecoverOptions(time=60.0, steps=5).time == 60.0
    with pytest.raises(OptionError, match="distill_features -1"):
        RecoverOptions(distill_features=-1)


def test_with_features_adds_the_block_outputs_relative_error() -> None:
    """The outputs' loss on the first n tensors plus weight × the mean relative squared error of the others;
    weight 0 is the loss itself."""
    from onnxprune.recovery.objective import with_features
    from onnxprune.recovery.train import kl_loss, relative_mse

    gen = torch.Generator().manual_seed(0)
    ts = [torch.randn(4, 10, generator=gen), torch.randn(4, 3, 5, generator=gen), torch.randn(4, 7, generator=gen)]
    ys = [t + 0.3 * torch.randn(t.shape, generator=gen) for t in ts]
    both = with_features(kl_loss, 1, 2.0)(ys, ts)
    expected = kl_loss(ys[:1], ts[:1]) + 2.0 * (relative_mse(ys[1:2], ts[1:2]) + relative_mse(ys[2:], ts[2:])) / 2
    assert float(both) == pytest.approx(float(expected), rel=1e-6) and float(both) > float(kl_loss(ys, ts))
    assert with_features(kl_loss, 1, 0.0) is kl_loss
    assert float(with_features(kl_loss, 1, 2.0)(ys[:1], ts[:1])) == pytest.approx(float(kl_loss(ys, ts)))


def test_whole_model_distillation_matches_the_block_outputs(tiny, student) -> None:
    """distill_features > 0 trains the whole model on its block outputs too: other weights than the outputs alone
    give, written back exactly, and the held-out verdict still on the outputs."""
    weights = lambda m: {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in m.graph.initializer}  # noqa: E731
    runs = {}
    for features in (0.0, 1.0):
        options = RecoverOptions(**fast_for("distill"), distill_segments=0, distill_features=features)
        model, report = recover(student, tiny.model, _calib(tiny), options)
        assert report.improved and report.writeback_error <= 1e-5 and report.metric == "kl"
        runs[features] = weights(model)
    assert runs[0.0] != runs[1.0]


def _yolo(rng: np.random.Generator, n: int = 6) -> np.ndarray:
    """YOLOv8-style [N, 4 + 3 classes, 84 anchors] at 64² (strides 8, 16, 32): decoded boxes, sigmoid scores,
    a few anchors with objects."""
    y = np.zeros((n, 7, 84))
    y[:, :2] = rng.uniform(8, 56, (n, 2, 84))
    y[:, 2:4] = rng.uniform(4, 24, (n, 2, 84))
    y[:, 4:] = rng.uniform(0, 0.02, (n, 3, 84))
    y[:, 4, :5] = 0.9
    return y


def test_a_detector_trains_on_the_objective_compress_allocates_by() -> None:
    """DetectLoss on torch tensors is tasks.Detect's objective, its sums add up over batches, and the verdict of a
    detector is 1 − its mAP50-95 against the teacher's detections."""
    from onnxprune.recovery.objective import DetectLoss, detect_task, objective
    from onnxprune.recovery.train import held_loss

    rng = np.random.default_rng(0)
    teacher = _yolo(rng)
    student = teacher.copy()
    student[:, :4] += rng.normal(0, 2, student[:, :4].shape)
    student[:, 4:] += rng.uniform(0, 0.05, student[:, 4:].shape)
    image = np.zeros((1, 3, 64, 64), np.float32)
    task = detect_task([teacher], [image])
    assert task is not None and task.layout.kind == "channels_first" and task.layout.classes == 3
    loss = objective([teacher], task)
    assert isinstance(loss, DetectLoss)
    expected = task.discrepancy([{"y": teacher}], [{"y": student}])
    assert float(loss([torch.from_numpy(student)], [torch.from_numpy(teacher)])) == pytest.approx(expected, rel=1e-9)

    class Identity(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (x,)

    held = held_loss(Identity(), [student], [teacher], np.arange(6), 4, loss)
    assert held == pytest.approx(expected, rel=1e-9)
    assert discrepancy([teacher], [teacher], task) == ("1-mAP50-95", 0.0, None)
    name, value, _ = discrepancy([student], [teacher], task)
    assert name == "1-mAP50-95" and 0.0 < value <= 1.0
    assert objective([np.zeros((2, 10))], None).__name__ == "kl_loss"


def test_detectors_whose_boxes_the_export_leaves_encoded_train_on_the_same_objective() -> None:
    """A raw-grid YOLOX and a PicoDet head (distance bins per level): ``detect_task`` finds them, and DetectLoss on
    torch tensors, through ``DetectionLayout.decoded``, equals ``tasks.Detect``'s discrepancy and has gradients."""
    from onnxprune.recovery.objective import DetectLoss, detect_task
    from onnxprune.tasks.boxes import cells

    rng = np.random.default_rng(1)
    image = np.zeros((1, 3, 64, 64), np.float32)
    a = sum(cells((64, 64), (8, 16, 32)))
    yolox = np.concatenate([rng.uniform(-0.5, 1.5, (4, a, 4)), rng.uniform(0, 0.05, (4, a, 3))], 2)
    yolox[:, :6, 4:] = 0.9  # a few objects
    levels = cells((64, 64), (8, 16, 32, 64))
    pico = [rng.uniform(0, 0.05, (4, c, 3)) for c in levels] + [rng.normal(0, 1, (4, c, 32)) for c in levels]
    pico[0][:, :5] = 0.8
    for teacher, kind in (([yolox], "anchors_first"), (pico, "split")):
        task = detect_task(teacher, [image])
        assert task is not None and task.layout.kind == kind
        student = [t + rng.normal(0, 0.05, t.shape) for t in teacher]
        expected = task.discrepancy([dict(enumerate(teacher))], [dict(enumerate(student))])
        ys = [torch.tensor(s, requires_grad=True) for s in student]
        loss = DetectLoss(task.layout)(ys, [torch.from_numpy(t) for t in teacher])
        assert float(loss.detach()) == pytest.approx(expected, rel=1e-9) and expected > 0
        loss.backward()
        assert all(y.grad is not None and torch.isfinite(y.grad).all() for y in ys)


def test_the_training_samples_are_thinned_evenly_in_whole_blocks_to_what_fits() -> None:
    train = np.arange(100)
    assert within(train, 20, 1000) is train
    kept = within(train, 20, 60)
    assert len(kept) == 40 and kept[0] == 0 and kept[-1] == 99 and np.all(np.diff(kept) >= 2)
    pairs = within(train, 20, 60, pair=2)  # an image and its mirror stay together
    assert len(pairs) == 40 and np.all(pairs[1::2] == pairs[::2] + 1) and np.all(pairs[::2] % 2 == 0)
    assert len(within(train, 20, 0, least=8)) == 8 and len(within(train, 20, 0, pair=2, least=4)) == 8


def test_a_time_budget_trains_on_as_many_samples_as_its_passes_fit(tiny, student, monkeypatch, capsys) -> None:
    """Under a time, the block stage's passes over every sample (unbounded by the loops' clocks: a detector at 640²
    spent four minutes of a one-minute budget there) are sized to their share of it from the teacher's time on the
    held-out samples; the rest of the training samples are left out, and the report says so."""
    import onnxprune.recovery.run as run_module
    from onnxprune.tables import print_recovery

    calib = _calib(tiny)
    _, report = recover(student, tiny.model, calib, RecoverOptions(time=3.0, provider="cpu"))
    assert report.samples_given == report.samples_train  # the tiny model's passes fit many times over
    monkeypatch.setattr(run_module, "PASSES_SHARE", 1e-9)
    monkeypatch.setattr(run_module, "PASSES_FLOOR", 1e-9)
    _, report = recover(student, tiny.model, calib, RecoverOptions(time=3.0, provider="cpu", batch_size=8))
    assert report.samples_train == 8 < report.samples_given and report.writeback_error <= 1e-4
    print_recovery(report)
    assert f"trained on 8 of the {report.samples_given} training samples" in capsys.readouterr().out


def test_a_weight_two_windows_share_is_trained_apart_and_written_back_exactly() -> None:
    """torch.onnx writes one initializer for equal weights (a transformer's norm weights and layer scales): here one
    per-channel scale after two of three convs. The head trains on inputs cached before it while the shared weight
    also acts there, so the model written back was not the one trained (here 7e-2, EdgeNeXt 1.45e-4, past the
    tolerance: no model returned). Recovery unties it first: one copy per reader, written back exactly."""
    from tests.onnx_builders import GraphBuilder

    b = GraphBuilder({"x": ["N", 3, 8, 8]})
    scale = b.const("scale", np.random.default_rng(1).uniform(0.5, 1.5, (1, 8, 1, 1)))
    h = b.op("Relu", [b.op("Mul", [b.conv("x", "c1", 3, 8), scale], "s1")], "r1")
    h = b.op("Relu", [b.conv(h, "c2", 8, 8)], "r2")
    h = b.op("Relu", [b.op("Mul", [b.conv(h, "c3", 8, 8), scale], "s3")], "r3")
    teacher = b.model([b.matmul(b.op("Flatten", [b.op("GlobalAveragePool", [h], "gap")], "flat"), "head", 8, 5)])
    student = onnx.ModelProto()
    student.CopyFrom(teacher)
    for t in student.graph.initializer:  # a pruned model's changed weights, in place
        if t.name in ("c1.w", "c2.w"):
            w = onnx.numpy_helper.to_array(t)
            t.CopyFrom(onnx.numpy_helper.from_array(w * np.float32(0.7), t.name))
    x = np.random.default_rng(0).standard_normal((48, 3, 8, 8)).astype(np.float32)
    data = ArraySet({"x": x}, np.arange(48), {"x": np.dtype(np.float32)})
    # a head of five segments reaches back past s3 and not past s1 (it raised "the written model differs" before)
    model, report = recover(student, teacher, data, RecoverOptions(**fast_for("distill"), distill_segments=5))
    assert report.writeback_error < 1e-5 and report.improved
    names = {t.name for t in model.graph.initializer}
    assert {"scale.s1", "scale.s3"} <= names and "scale" not in names


def test_tensor_adam_moves_a_weight_with_a_small_gradient_little() -> None:
    """Adam moves every weight by about its learning rate, whatever its gradient's size; ``TensorAdam`` scales a
    tensor's steps by one second moment, so a weight whose gradient is a thousandth of its neighbours' moves a
    thousandth as far, and a tensor's steps stay free of its gradient's overall scale."""
    from onnxprune.recovery.train import TensorAdam

    def moved(make, scale: float) -> torch.Tensor:
        w = torch.nn.Parameter(torch.zeros(4))
        opt = make([w], lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            (w * torch.tensor([1.0, 1.0, 1.0, 1e-3]) * scale).sum().backward()
            opt.step()
        return w.detach().abs()

    adam, tensor = moved(torch.optim.Adam, 1.0), moved(TensorAdam, 1.0)
    assert torch.allclose(adam, torch.full((4,), 0.5), rtol=1e-3)
    assert torch.allclose(tensor[3] / tensor[0], torch.tensor(1e-3), rtol=1e-3)
    assert 0.4 < float(tensor[0]) < 0.8
    assert torch.allclose(moved(TensorAdam, 1e-4), tensor, rtol=1e-3)


def test_both_stages_train_with_the_optimizer_asked(tiny, student, monkeypatch: pytest.MonkeyPatch) -> None:
    """``optimizer='tensor-adam'`` reaches every loop of the block stage and of the whole model's distillation (its
    learning-rate trials included), and the run still gains."""
    from onnxprune.recovery import train

    made = []

    def recording(kind, params, lr):
        made.append((train.Optimizer(kind), len(params)))
        return original(kind, params, lr)

    original = train.optimizer_for
    monkeypatch.setattr(train, "optimizer_for", recording)
    options = RecoverOptions(**{**FAST, "distill_lr": None}, distill_segments=0, optimizer="tensor-adam")
    _, report = recover(student, tiny.model, _calib(tiny), options)
    assert report.segments and report.distill.whole_model and report.distill.lr_trials
    assert len(made) >= len(report.segments) + len(report.distill.lr_trials)
    assert {kind for kind, _ in made} == {train.Optimizer.TENSOR_ADAM} and report.improved
