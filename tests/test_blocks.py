"""Residual blocks removed whole: found by the analysis, cut by ``passes.remove_block``, chosen by the output
allocation and written by ``compress`` as the shortcut plus the mean of the block's output."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest

from onnxprune.budget.allocation import curve_widths
from onnxprune.analysis import analyze, consumers
from onnxprune.ir.shapes import infer_shapes
from onnxprune.calib.sources import load_calibration
from onnxprune.errors import OptionError
from onnxprune.passes import remove_block
from onnxprune.pipeline import compress, schedule
from onnxprune.ir.ort import model_input_specs
from onnxprune.ir.cuts import Liveness, run_segment
from onnxprune.strategies.sensitivity import curve_of
from onnxprune.strategies import Allocator, MACs, Recoverable, named, options_from
from tests.onnx_builders import run


def _model(name: str, tiny, zoo) -> onnx.ModelProto:
    return tiny.model if name == "tiny" else zoo.model(name)


@pytest.mark.parametrize(("name", "count"), [("tiny", 1), ("mobilenet_v2", 10), ("resnet34", 13), ("resnet50", 0)])
def test_the_removable_blocks_of_the_zoo(name: str, count: int, tiny, zoo) -> None:
    """Blocks with an identity shortcut and one hidden group: MobileNetV2's repeated inverted residuals,
    ResNet-34's basic blocks without a downsample; ResNet-50's bottlenecks hold two groups in series."""
    analysis = analyze(_model(name, tiny, zoo))
    assert len(analysis.blocks) == count
    nodes = {n.name: n for n in analysis.graph.nodes}
    for gid, block in analysis.blocks.items():
        group = analysis.groups[gid]
        assert [c.node for c in group.consumers] == [block.consumer]
        assert nodes[block.add].op == "Add" and nodes[group.producers[0]].inputs[0] in nodes[block.add].inputs
    assert [g["removable_block"] for g in analysis.to_dict()["groups"]].count(True) == count


def _bias_reference(model: onnx.ModelProto, biases: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The original with each named consumer's weights zeroed and its bias replaced."""
    graph = analyze(model).graph.copy()
    nodes = {n.name: n for n in graph.nodes}
    for name, bias in biases.items():
        lin = consumers.matrix(nodes[name])
        consumers.write(graph, nodes[name], consumers.Linear(np.zeros_like(lin.weight), bias, lin.k))
    return infer_shapes(gs.export_onnx(graph))


@pytest.mark.parametrize("name", ["tiny", "mobilenet_v2", "resnet34"])
def test_removing_blocks_keeps_the_graph_valid_and_its_io(name: str, tiny, zoo) -> None:
    """Every removable block cut at once: a valid model with the same inputs and outputs, and the same output
    as the original whose closing convs write their bias alone."""
    model = _model(name, tiny, zoo)
    analysis = analyze(model)
    rng = np.random.default_rng(0)
    graph, biases = analysis.graph.copy(), {}
    for block in analysis.blocks.values():
        channels = next(n for n in graph.nodes if n.name == block.consumer).outputs[0].shape[1]
        biases[block.consumer] = rng.standard_normal(channels).astype(np.float32)
        graph = remove_block(graph, block, biases[block.consumer])
    pruned = infer_shapes(gs.export_onnx(graph))
    onnx.checker.check_model(pruned, full_check=True)
    io = lambda m: [(v.name, str(v.type)) for v in (*m.graph.input, *m.graph.output)]  # noqa: E731
    assert io(pruned) == io(model)
    removed = {n.name for n in analysis.graph.nodes} - {n.name for n in pruned.graph.node}
    assert {b.consumer for b in analysis.blocks.values()} <= removed
    assert {analysis.groups[g].producers[0] for g in analysis.blocks} <= removed
    assert analyze(pruned).macs.total < analysis.macs.total
    x = rng.standard_normal((2, *model_input_specs(model)[0][1][1:])).astype(np.float32)
    (got,), (want,) = run(pruned, input=x), run(_bias_reference(model, biases), input=x)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


@dataclass(frozen=True)
class BlocksOnly(Allocator):
    """The groups of ``blocks`` removed, every other group whole."""

    blocks: frozenset[int] = frozenset()
    needs_curves = False

    def widths(self, cost, groups, curves, target, min_channels, round_to):
        return {g.id: 0 if g.id in self.blocks else g.channels for g in groups}


def test_compress_writes_the_removed_block_as_its_shortcut_plus_the_mean_output(tiny) -> None:
    """Width 0 on a removable block: its consumer's refit with no channel is the mean of its output over the
    calibration positions (computed here on the original), written as the constant the Add reads."""
    analysis = analyze(tiny.model)
    (gid,), (block,) = analysis.blocks, analysis.blocks.values()
    calib = load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    options = options_from(MACs(analysis.macs.total - 1), allocate=BlocksOnly(frozenset({gid})), provider="cpu",
                           round_to=1)
    pruned, report = compress(tiny.model, calib, options)
    onnx.checker.check_model(pruned, full_check=True)
    (layer,) = report.layers
    assert (layer.group, layer.kept, layer.error) == (analysis.groups[gid].name, 0, 1.0)
    assert analyze(pruned).macs.total == report.macs_after
    assert report.macs_after == pytest.approx(analysis.macs.macs({gid: 0}))
    y = next(n for n in analysis.graph.nodes if n.name == block.consumer).outputs[0].name
    out, _ = run_segment(analysis.graph, {"input": tiny.x}, [y], provider="cpu", batch_size=16)
    mean = out[y].mean(axis=(0, 2, 3))
    (got,), (want,) = run(pruned, input=tiny.x[:8]), run(_bias_reference(tiny.model, {block.consumer: mean}),
                                                          input=tiny.x[:8])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_the_allocation_removes_a_block_when_that_degrades_the_output_least(tiny) -> None:
    """A block whose removal is probed as nearly harmless is removed, the rest filled to the budget (within 1%);
    the same curves without the removal probe narrow groups instead."""
    analysis = analyze(tiny.model)
    order, _ = schedule(analysis, Liveness(analysis.graph))
    groups = [g for _, g in order]
    (gid,) = analysis.blocks
    block_macs = analysis.macs.total - analysis.macs.macs({gid: 0})
    target = analysis.macs.total - 1.2 * block_macs
    scale = {g.id: 0.001 if g.id == gid else 1.0 for g in groups}
    probes = {g.id: {int(g.channels * r): scale[g.id] * (1 - r) for r in (0.75, 0.5, 0.25)} for g in groups}
    with_removal = {g.id: curve_of(g.channels, {**probes[g.id], **({0: 0.002} if g.id == gid else {})})
                    for g in groups}
    widths = curve_widths(analysis.macs, groups, with_removal, target, round_to=1)
    assert widths[gid] == 0
    assert 0.99 * target <= analysis.macs.macs(widths) <= target
    without = {g.id: curve_of(g.channels, probes[g.id]) for g in groups}
    widths = curve_widths(analysis.macs, groups, without, target, round_to=1)
    assert min(widths.values()) > 0 and analysis.macs.macs(widths) <= target


def test_block_removal_goes_with_the_output_allocations_only() -> None:
    assert named("omp", "output", "refit", remove_blocks=True)[1].remove_blocks
    assert named("omp", "recover", "refit", remove_blocks=True)[1] == Recoverable(remove_blocks=True)
    with pytest.raises(OptionError, match="block removal is chosen by the output allocation, not by epsilon"):
        named("omp", "epsilon", "refit", remove_blocks=True)


def test_the_removal_probe_is_the_output_of_the_block_written_as_its_mean(tiny) -> None:
    """The probe at width 0 (the consumer's columns cleared, its bias the mean target on the fit samples)
    measures the model whose block is replaced by that constant, run whole here."""
    from onnxprune.pipeline import Compressor
    from onnxprune.ir.cuts import cut_graph
    from onnxprune.strategies.objects import run_chunks
    from onnxprune.strategies.sensitivity import _probe
    from onnxprune.tasks import raw_discrepancy
    from onnxprune.strategies import Ratio

    calib = load_calibration(str(tiny.calib), model_input_specs(tiny.model))
    run_ = Compressor(tiny.model, calib, options_from(Ratio(0.6), provider="cpu"))
    order, _ = schedule(run_.analysis, run_.live)
    (gid,), (block,) = run_.analysis.blocks, run_.analysis.blocks.values()
    cut, group = next((c, g) for c, g in order if g.id == gid)
    fit, probe = {k: v[:32] for k, v in run_.inputs.items()}, {k: v[32:] for k, v in run_.inputs.items()}
    names = {t.name for t in run_.original.outputs}
    reference = run_chunks(run_, cut_graph(run_.original, probe, names), probe)
    at_cut, fitted = dict(probe), dict(fit)
    run_.advance(run_.original, at_cut, cut)
    run_.advance(run_.original, fitted, cut)
    fitted = run_.peek(run_.original, fitted, {use.tensor for use in group.consumers})
    got = _probe(run_, group, fitted, at_cut, reference, [0])[0]
    y = next(n for n in run_.original.nodes if n.name == block.consumer).outputs[0].name
    mean = run_segment(run_.original, fit, [y], provider="cpu", batch_size=16)[0][y].mean(axis=(0, 2, 3))
    removed = _bias_reference(tiny.model, {block.consumer: mean})
    (out,) = run(removed, input=probe["input"])
    want = raw_discrepancy([{k: np.concatenate([r[k] for r in reference]) for k in names}], [{"logits": out}])
    assert got == pytest.approx(want, rel=1e-4) and got > 0
