"""``sweep``: one calibration and one set of output-allocation probes shared by many budgets, each budget's model
(and its INT8 model, when asked) judged on held-out samples by the task's metric against the original and timed;
``keep``: the cheapest budget whose held-out metric, less its spread over the samples, stays at or above a floor."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from onnxprune import api
from onnxprune.calib.images import Preprocess
from onnxprune.calib.sources import ArraySet, CalibrationSet
from onnxprune.deploy.quantize import QuantizeOptions
from onnxprune.errors import OptionError, TargetError
from onnxprune.deploy.evaluation import fidelity
from onnxprune.fileio import atomic_write, save_model
from onnxprune.normal import written
from onnxprune.strategies import OMP, Allocator, Budget, Output, Ratio, Reconstruction, Refit, Selector, Shared
from onnxprune.strategies.sensitivity import objects_seen

KEEP_LADDER = (0.9, 0.8, 0.7, 0.6, 0.5)  # the MAC ratios ``keep`` judges first
KEEP_MILDER = (0.95, 0.975, 0.9875)  # judged in turn (the gap to the original halved) while none keeps the floor
KEEP_REFINE = 2  # halvings of the gap between the cheapest ratio that keeps the floor and the next one


@dataclass
class SweepRow:
    """One budget's model: its size, its held-out fidelity to the original, its latency."""

    target: str
    macs: int
    params: int
    mac_ratio: float
    metric: str  # what ``fidelity`` is (``FIDELITY``, 'agreement' or 'cosine')
    fidelity: float | None
    agreement: float | None  # a classifier's top-1 agreement with the original
    kl: float | None
    spread: float | None = None  # the fidelity's standard deviation over the held-out samples (``EvalResult.spread``)
    latency_ms: float | None = None  # median, batch 1, onnxruntime on the CPU
    speedup: float | None = None  # the original's latency over this one's, timed in the same rounds
    path: str = ""
    seconds: float = 0.0  # this budget's compress (the shared probes counted in the first)
    int8: SweepRow | None = None  # the INT8 model of this budget (``sweep(int8=...)``), judged and timed the same way

    @property
    def lower(self) -> float | None:
        """The fidelity less its spread: what ``keep`` compares with its floor."""
        return None if self.fidelity is None else self.fidelity - (self.spread or 0.0)

    @property
    def written(self) -> SweepRow:
        """The model this budget writes: its INT8 model where one was made."""
        return self.int8 or self


@dataclass
class SweepResult:
    """The rows by MACs, the original's figures, what judged them, and ``keep``'s answer where asked."""

    rows: list[SweepRow]
    original: dict
    held: str  # which samples judged the models
    seconds: float
    keep: dict | None = None  # {"floor", "chosen" (target or None), "judged", "metric"}
    objects: tuple[int, int] | None = None  # a detector's probe samples with an object to the original, of how many
    kept: dict | None = None  # a detector's calibration samples with objects and those each run kept (``objects``)

    def to_dict(self) -> dict:
        return asdict(self)


def sweep(
    model: api.ModelSource,
    calib: str | Path,
    targets: Mapping[str, Budget],
    out_dir: str | Path,
    *,
    held: str | Path | None = None,
    keep: float | None = None,
    subset: str | None = None,
    flip: bool | None = None,
    preprocess: Preprocess | None = None,
    input_shape: Sequence[str] | None = None,
    select: Selector = OMP(),
    allocate: Allocator = Output(),
    reconstruct: Reconstruction = Refit(),
    round_to: int = 8,
    batch_size: int = 32,
    provider: str = "auto",
    memory: int | str | None = None,
    task: str = "auto",
    bench: bool = True,
    int8: QuantizeOptions | None = None,
    on_layer: Callable[[int, int, str], None] | None = None,
) -> SweepResult:
    """Compress ``model`` to each of ``targets`` (label -> budget) on one calibration of ``calib`` (an image folder) and one set of
    probes, writing every model and its report to ``out_dir``; judge each on held-out images (``held``, else every
    fifth image of ``calib``, which then calibrates on the others) by the task's metric against the original, and
    time it. ``flip``: as ``compress``'s (None: the mirrors for a classifier). With ``int8``, each model is also
    quantized (``onnxprune.quantize``, choosing on a split of the calibration samples) and its INT8 model judged
    and timed the same way. With ``keep``, also find the cheapest MAC ratio whose held-out metric less its spread
    (``SweepRow.lower``; of the INT8 model with ``int8``) is at least ``keep``: the targets, else ``KEEP_LADDER``
    (then ``KEEP_MILDER`` while none keeps it), then ``KEEP_REFINE`` halvings; a floor that the mildest budget
    misses is a TargetError."""
    start = time.perf_counter()
    if held is None and subset is not None:
        raise OptionError("a sweep holds out every fifth image of --calib when no --held folder is given, and "
                          "--subset would pick among them too: give --held, or leave out --subset", option="held")
    onnx_model = api.load(model, input_shape)
    prep = preprocess or api.preprocess_for(onnx_model)
    data = _in_memory(api.calibration(calib, onnx_model, prep, subset=subset if held is not None else "!0%5",
                                      flip=flip))
    held_dir, held_subset = (Path(held), None) if held is not None else (Path(calib), "0%5")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)  # once the model and the samples are read: a refusal leaves nothing
    original_path = out / "original.onnx"
    save_model(written(onnx_model), original_path)
    shared = Shared(allocate)
    judged: dict[str, SweepRow] = {}
    original = {"macs": 0, "params": 0, "path": str(original_path), "latency_ms": None}  # from the first report
    probed: list[tuple[int, int] | None] = []  # each report's count of the shared probes' samples with objects
    kept: list[dict | None] = []  # each report's calibration samples with objects and kept (the same in every run)

    def judge(label: str, budget: Budget) -> SweepRow:
        t0 = time.perf_counter()
        result = api.compress(onnx_model, data, budget=budget, select=select, allocate=shared,
                              reconstruct=reconstruct, preprocess=prep, round_to=round_to, batch_size=batch_size,
                              provider=provider, memory=memory, task=task,
                              on_layer=on_layer and (lambda i, n, text: on_layer(i, n, f"[{label}] {text}")))
        seconds = time.perf_counter() - t0
        name = re.sub(r"[^\w.]+", "_", label)
        path = out / f"{name}.onnx"
        result.save(path, refuse=[original_path])
        atomic_write(out / f"{name}.json", lambda tmp: tmp.write_text(_json(result.to_dict())))
        r = result.report
        probed.append(objects_seen(r.allocation))
        kept.append(r.objects)
        original.update(macs=int(r.macs_before), params=int(r.params_before))
        row = measured(SweepRow(label, int(r.macs_after), int(r.params_after), r.macs_after / r.macs_before, "", None,
                                None, None, path=str(path), seconds=seconds))
        if int8 is not None:
            t0 = time.perf_counter()
            quantized, q_path = result.quantize_beside(path, int8, refuse=[original_path])
            row.int8 = measured(replace(row, path=str(q_path), seconds=time.perf_counter() - t0),
                                simulate_qdq=quantized.report.simulated)
        judged[label] = row
        return row

    def measured(row: SweepRow, simulate_qdq: bool = False) -> SweepRow:
        """``row`` with the held-out scores of its model against the original."""
        scores = api.evaluate(row.path, held_dir, original_path, preprocess=prep, subset=held_subset,
                              batch_size=batch_size, provider=provider, task=task, simulate_qdq=simulate_qdq)
        row.metric, row.fidelity = fidelity(scores)
        row.agreement, row.kl, row.spread = scores.agreement, scores.kl, scores.spread.get(row.metric)
        return row

    for label, budget in targets.items():
        judge(label, budget)
    chosen = None
    if keep is not None:
        chosen = _keep(keep, judged, judge, bool(targets))
    rows = sorted(judged.values(), key=lambda r: -r.macs)
    if bench:
        models = [m for r in rows for m in (r, r.int8) if m is not None]
        timed = api.bench([original_path, *(Path(m.path) for m in models)], provider="cpu", batch=1)
        original["latency_ms"] = timed[0].median_ms
        for row, t in zip(models, timed[1:]):
            row.latency_ms, row.speedup = t.median_ms, timed[0].median_ms / t.median_ms
    result = SweepResult(rows, original, f"{held_dir} ({held_subset or 'all'})", time.perf_counter() - start,
                         objects=probed[0] if probed else None, kept=kept[0] if kept else None)
    if keep is not None:
        result.keep = {"floor": keep, "chosen": chosen, "judged": len(judged), "metric": rows[0].metric}
    atomic_write(out / "sweep.json", lambda tmp: tmp.write_text(_json(result.to_dict())))
    plot(result, out / "sweep.png")
    return result


def _in_memory(data: CalibrationSet) -> ArraySet:
    """``data`` decoded once (an image folder decodes its images on every pass, and every budget makes several)."""
    batches = list(data.batches(256))
    arrays = {k: np.concatenate([b[k] for b in batches]) for k in data.input_names}
    return ArraySet(arrays, np.arange(len(data)), {k: a.dtype for k, a in arrays.items()})


def _keep(floor: float, judged: dict[str, SweepRow], judge: Callable[[str, Budget], SweepRow],
          given: bool) -> str:
    """The label of the cheapest judged budget whose written model's fidelity less its spread (``SweepRow.lower``) is
    at least ``floor``, after judging ``KEEP_LADDER`` (unless targets were given; then ``KEEP_MILDER`` while none
    keeps it) and ``KEEP_REFINE`` ratios between the cheapest that keeps it and the next."""
    def keeps(row: SweepRow) -> bool:
        lower = row.written.lower
        return lower is not None and lower >= floor

    if not given:
        for ratio in KEEP_LADDER:
            if not keeps(judge(f"{ratio:g}", Ratio(ratio))):
                break
        for ratio in KEEP_MILDER:
            if any(keeps(r) for r in judged.values()):
                break
            judge(f"{ratio:g}", Ratio(ratio))

    def passing() -> list[SweepRow]:
        return sorted((r for r in judged.values() if keeps(r)), key=lambda r: r.macs)

    if not passing():
        mildest = max(judged.values(), key=lambda r: r.macs).written
        raise TargetError(f"no budget keeps {mildest.metric} ≥ {floor:g} on the held-out images (less its spread over "
                          f"them): the mildest judged ({mildest.target}, {mildest.mac_ratio:.3f}× MACs) reaches "
                          f"{_fmt(mildest.fidelity)} ± {_fmt(mildest.spread)}", option="keep")
    for _ in range(KEEP_REFINE):
        best = passing()[0]
        cheaper = [r for r in judged.values() if r.macs < best.macs]
        if not cheaper:
            break
        below = max(cheaper, key=lambda r: r.macs)
        ratio = round((best.mac_ratio + below.mac_ratio) / 2, 3)
        if f"{ratio:g}" in judged or abs(best.mac_ratio - below.mac_ratio) < 0.02:
            break
        judge(f"{ratio:g}", Ratio(ratio))
    return passing()[0].target


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _json(data: dict) -> str:
    return json.dumps(data, indent=2)


def plot(result: SweepResult, path: Path) -> None:
    """Fidelity against speed-up (MAC reduction without timings), the INT8 models' curve beside, the original
    marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = all(r.speedup is not None for r in result.rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = [("pruned", result.rows)]
    if result.rows and all(r.int8 is not None for r in result.rows):
        curves.append(("pruned, INT8", [r.int8 for r in result.rows]))
    for label, rows in curves:
        xs = [r.speedup if timed else 1 / r.mac_ratio for r in rows]
        ys = [r.fidelity for r in rows]
        ax.plot(xs, ys, "o-", label=label)
        for x, y, r in zip(xs, ys, rows):
            if y is not None:
                ax.annotate(r.target, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.plot([1.0], [1.0], "k*", markersize=12, label="original")
    if result.keep is not None:
        ax.axhline(result.keep["floor"], color="grey", linestyle="--", linewidth=1, label="keep floor")
    metric = result.rows[0].metric if result.rows else "fidelity"
    ax.set_xlabel("speed-up (batch 1, onnxruntime CPU)" if timed else "MAC reduction (original / pruned)")
    ax.set_ylabel(f"{metric} vs the original (held-out)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["SweepResult", "SweepRow", "fidelity", "sweep"]
