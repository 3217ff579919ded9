"""Which groups ``compress`` prunes, at which cut, and why the others are left alone."""

from __future__ import annotations

from onnxprune.analysis import Analysis
from onnxprune.analysis.groups import Group, is_gate
from onnxprune.errors import AnalysisError
from onnxprune.ir.cuts import Liveness

# Integer/quantized ops that stand where float Conv/MatMul would: a quantized model has no float channels to prune.
QUANTIZED_OPS = frozenset({"ConvInteger", "MatMulInteger", "QLinearConv", "QLinearMatMul", "DynamicQuantizeLinear",
                           "QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLSTM"})


def schedule(analysis: Analysis, live: Liveness, streams: bool = False) -> tuple[list[tuple[int, Group]], list[dict]]:
    """Prunable groups with their cut (position of the first consumer), and those left alone.

    A group is pruned at its cut. Producers that run after it are either gates (squeeze-excite: one value
    per channel and sample, computed from the group's pooled channels by its first consumer) or, in a
    residual stream (the outputs of several blocks summed by ``Add``s), the later blocks' projections: their
    rows are sliced at the cut, and the consumers that read the stream later are refitted when the loop
    reaches them (``Compressor.refit_pending``); a stream may be a piece of a Split/Concat (YOLO's C2f). A
    group that mixes gates with other later producers is left alone. Consumers that read the channels later
    are fed by running ahead from the cut (``peek``). Residual streams are pruned only with ``streams``.
    """
    order, skipped = [], []
    nodes = {n.name: n for n in analysis.graph.nodes}
    for g in analysis.groups:
        if not g.prunable:
            skipped.append({"group": g.name, "channels": g.channels, "reason": g.reason})
            continue
        cut = min(live.position[c.node] for c in g.consumers)
        later = [p for p in g.producers if live.position[p] >= cut]
        gates = [p for p in later if is_gate(nodes[p])]
        if gates and len(gates) < len(later):
            skipped.append({"group": g.name, "channels": g.channels,
                            "reason": "coupled across layers through a gate and other later producers: not pruned "
                                      "by this release"})
            continue
        if later and not gates and not streams:
            skipped.append({"group": g.name, "channels": g.channels,
                            "reason": "a residual stream (several blocks' outputs summed by Adds): pruned only "
                                      "with --residual-streams"})
            continue
        order.append((cut, g))
    # An SE reducer's own group is cut at the gate producer, after the gated group sliced that producer's
    # rows: its statistics would no longer match the original's outputs.
    gates = {p: g for cut, g in order for p in g.producers if live.position[p] >= cut and is_gate(nodes[p])}
    for cut, g in list(order):
        gated = next((gates[c.node] for c in g.consumers if c.node in gates and gates[c.node] is not g), None)
        if gated is not None:
            order.remove((cut, g))
            skipped.append({"group": g.name, "channels": g.channels,
                            "reason": f"reduces the pooled channels of the gated group {gated.name}, pruned before it: "
                                      "not pruned"})
    order.sort(key=lambda item: item[0])
    if not order:
        if not skipped:
            quantized = sorted({n.op for n in analysis.graph.nodes if n.op in QUANTIZED_OPS})
            hint = (f"; the model is quantized ({', '.join(quantized)}): prune the float model, then quantize it"
                    if quantized else "")
            raise AnalysisError("no prunable channel group in this graph: no channels run from a Conv, ConvTranspose, "
                                f"Gemm or MatMul to another{hint}")
        reasons = list(dict.fromkeys(s["reason"] for s in skipped))
        shown = "; ".join(reasons[:3]) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3 else "")
        groups = f"{len(skipped)} group" + "s" * (len(skipped) > 1)
        raise AnalysisError(f"no prunable channel group in this graph ({groups}: {shown}); "
                            "`onnxprune analyze` lists every group")
    return order, skipped
