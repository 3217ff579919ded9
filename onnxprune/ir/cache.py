"""The pruning loop's runs of a graph from its cached tensors: which tensors stay cached at a cut (``Liveness``), how
onnxruntime runs the others (provider, batch, a batch the graph fixes) and the store their arrays go into."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import onnx_graphsurgeon as gs

from onnxprune.ir.cuts import Liveness, batchless, run_segment
from onnxprune.ir.store import Array, Store


class Cache:
    """Runs ``graph`` from the cached ``values`` of one network (the loop holds two: the pruned prefix's and the
    original's), every run with the same provider, batch and store; ``ran``: the execution provider that last ran."""

    def __init__(self, live: Liveness, store: Store, provider: str, run_batch: int, exact: bool) -> None:
        self.live = live
        self.store = store
        self.provider = provider  # as asked ("auto" included)
        self.run_batch = run_batch
        self.exact = exact  # the graph fixes its batch: every run has exactly run_batch samples
        self.ran: str | None = None
        self.on_chunk: Callable[[int, int], None] | None = None  # (samples done, total) as a run advances

    def run(self, graph: gs.Graph, values: dict[str, Array], names: Iterable[str],
            progress: bool = True) -> dict[str, Array]:
        """The tensors ``names`` computed from ``values`` (all samples), in the store's arrays."""
        new, ran = run_segment(graph, values, names, provider=self.provider, batch_size=self.run_batch,
                               exact=self.exact, store=self.store, on_chunk=self.on_chunk if progress else None)
        self.ran = ran or self.ran
        return new

    def advance(self, graph: gs.Graph, values: dict[str, Array], cut: int) -> None:
        """Bring the cached tensors ``values`` of ``graph`` to those live at ``cut`` (in place)."""
        live = self.live.live(cut)
        tensors = graph.tensors()  # a removed block's tensors are gone from the pruned graph
        values.update(self.run(graph, values, {t for t in live - set(values) if t in tensors}))
        for name in set(values) - live:
            del values[name]

    def peek(self, graph: gs.Graph, values: dict[str, Array], names: set[str]) -> dict[str, Array]:
        """``values`` plus the tensors ``names`` not cached yet, computed ahead (not kept in the cache)."""
        return {**values, **self.run(graph, values, names - set(values))}

    def batchless(self, graph: gs.Graph, inputs: dict[str, Array], names: set[str]) -> dict[str, list[int]]:
        """The tensors among ``names`` that could not be cached (no samples on their first axis), with their shape,
        from one run on the first samples: 2 of them where the batch is free (a batch of 1 hides a [T, C] tensor's
        T = 1)."""
        some = {name: v[: self.probe_batch] for name, v in inputs.items()}
        return batchless(graph, some, names, provider=self.provider, batch_size=self.probe_batch, exact=self.exact)

    @property
    def probe_batch(self) -> int:
        """The samples of ``batchless``'s run."""
        return self.run_batch if self.exact else 2
