"""The global-imitation objective of one channel group, evaluated on the downstream graph.

``FedCut`` runs the part of the graph after a cut in onnxruntime with the group's consumers' weights and biases as
graph inputs: each candidate (the consumers refitted on a candidate support) is one run of the same session. The
output allocation's probes use it directly; ``ConsumerDownstream`` (what ``--method global`` and ``auto`` use)
scores the candidates on chosen samples by ``tasks.raw_discrepancy`` against the original network's outputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis import consumers
from onnxprune.errors import ModelError
from onnxprune.ir.ort import graph_session
from onnxprune.ir.cuts import cut_graph, run_chunks, settle
from onnxprune.ir.store import Array
from onnxprune.tasks import raw_discrepancy


__all__ = ["ConsumerDownstream", "FedCut"]


class FedCut:
    """The part of ``graph`` after a cut (``ir.cuts.cut_graph``: the tensors ``at_cut`` in, ``outputs``
    out) with the consumers ``nodes``' weights and biases as graph inputs, so that one onnxruntime session runs
    every candidate weighting of them. ``exact_batch``: the batch a graph that fixes it runs at (short runs are
    padded), else None. ``prepack=False``: onnxruntime does not pre-pack the weights (``ir.ort.make_session``), for
    a session that runs a few candidates. ``settle_once``: the nodes that neither are the consumers nor read them run
    once here (``ir.cuts.settle``: a detector's other heads), not in every candidate's run. The session keeps
    onnxruntime's memory arena: it runs several candidates on the same samples."""

    def __init__(self, graph: gs.Graph, at_cut: Mapping[str, Array], nodes: Sequence[str], outputs: Sequence[str],
                 *, provider: str, exact_batch: int | None = None, prepack: bool = True, settle_once: bool = True
                 ) -> None:
        cut = cut_graph(graph, dict(at_cut), outputs)
        mine = {n.name: n for n in cut.nodes}
        missing = [name for name in nodes if name not in mine]
        if missing:
            raise ModelError(f"consumer(s) {missing} do not run after the cut: the network's outputs do not read them")
        for name in nodes:  # a bias everywhere (a MatMul's is an Add), so that every candidate can set one
            lin = consumers.matrix(mine[name])
            consumers.write(cut, mine[name], consumers.Linear(lin.weight, np.ones_like(lin.bias), lin.k))
        cut.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
        if settle_once:
            rows = exact_batch or len(next(iter(at_cut.values())))
            settled = settle(cut, dict(at_cut), nodes, provider=provider, batch_size=rows,
                             exact=exact_batch is not None)
            if settled.keys() != at_cut.keys():
                at_cut, cut = settled, cut_graph(cut, settled, outputs)
                mine = {n.name: n for n in cut.nodes}
        self._scratch = cut.copy()  # candidates are written here, in each op's layout, then fed
        self._nodes = list(nodes)
        feeds = []
        for name in nodes:
            for tensor in consumers.parameters(mine[name]):
                var = gs.Variable(tensor.name, dtype=tensor.values.dtype, shape=list(tensor.shape))
                for user in list(tensor.outputs):
                    user.inputs[user.inputs.index(tensor)] = var
                feeds.append(var)
        cut.inputs = [*cut.inputs, *feeds]
        self.session, self.provider = graph_session(cut, provider, arena=True, prepack=prepack)
        self._outputs = [t.name for t in cut.outputs]
        self.at_cut = {t.name: at_cut[t.name] for t in cut.inputs if t.name in at_cut}
        self.exact_batch = exact_batch

    def weights(self, linears: Sequence[consumers.Linear]) -> dict[str, np.ndarray]:
        """The session's weight and bias feeds of one candidate (a full ``Linear`` per consumer)."""
        nodes = {n.name: n for n in self._scratch.nodes}
        out = {}
        for name, lin in zip(self._nodes, linears, strict=True):
            node = nodes[name]
            consumers.write(self._scratch, node, lin)
            for tensor in consumers.parameters(node):
                out[tensor.name] = np.asarray(tensor.values)
        return out

    def run(self, linears: Sequence[consumers.Linear], values: Mapping[str, Array], rows: int
            ) -> list[dict[str, np.ndarray]]:
        """The outputs with the consumers weighted by ``linears`` on ``values`` (the tensors at the cut), chunk by
        chunk, ``rows`` samples a run (``exact_batch``'s where the graph fixes it)."""
        chunks = run_chunks(self.session, self._outputs, dict(values), self.exact_batch or rows,
                            self.exact_batch is not None, self.weights(linears))
        return [arrays for _, arrays in chunks]


class ConsumerDownstream(FedCut):
    """The network's final-output discrepancy when the consumers ``nodes`` take candidate weights.

    graph: the network as pruned so far; at_cut: the tensors alive at the cut, (samples, ...) each;
    reference: the original network's outputs on the same samples (output name -> array). ``exact_batch``:
    the batch a graph that fixes it runs at (short runs are padded), else None.
    """

    def __init__(self, graph: gs.Graph, at_cut: Mapping[str, Array], nodes: Sequence[str],
                 reference: Mapping[str, Array], *, provider: str, exact_batch: int | None = None) -> None:
        super().__init__(graph, at_cut, nodes, list(reference), provider=provider, exact_batch=exact_batch,
                         settle_once=False)  # its tensors at the cut are the whole set's: what settles would be held
        self._reference = reference

    def samples(self, idx: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The tensors at the cut and the reference outputs of samples ``idx`` (sorted), read once for many
        candidates."""
        return ({k: np.ascontiguousarray(v[idx]) for k, v in self.at_cut.items()},
                {k: np.asarray(v[idx]) for k, v in self._reference.items()})

    def losses(self, candidates: Sequence[Sequence[consumers.Linear]],
               samples: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]) -> np.ndarray:
        """The discrepancy of each candidate on ``samples`` (from ``samples()``), (K,) float64."""
        values, reference = samples
        n = len(next(iter(reference.values())))
        rows = self.exact_batch or n
        ref = [{k: v[s : s + rows] for k, v in reference.items()} for s in range(0, n, rows)]
        return np.array([raw_discrepancy(ref, self.run(linears, values, n)) for linears in candidates])
