"""Run a graph cut by cut over the whole calibration set, keeping only the live tensors.

Pruning goes layer by layer from the input, each layer on data pushed through the already-pruned
prefix. Instead of re-running the prefix for every layer, the tensors alive at a cut (produced
before it, read after it) are cached for all samples and each segment between two cuts runs once,
as an onnxruntime sub-model.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator

import numpy as np
import onnx_graphsurgeon as gs
import onnxruntime as ort

from onnxprune.errors import AnalysisError
from onnxprune.ir.ort import graph_session
from onnxprune.ir.shapes import graph_batch, sample_rows
from onnxprune.ir.store import Array, Store
from onnxprune.ir.subgraphs import outer_reads


class Liveness:
    """Where each tensor is produced and last read, by position in a fixed node order."""

    def __init__(self, graph: gs.Graph) -> None:
        self.position = {node.name: i for i, node in enumerate(graph.nodes)}
        end = len(graph.nodes)
        self.produced: dict[str, int] = {t.name: -1 for t in graph.inputs}
        self.last_use: dict[str, int] = {t.name: end for t in graph.outputs}
        for i, node in enumerate(graph.nodes):
            for t in node.outputs:
                self.produced[t.name] = i
            for t in [*node.inputs, *outer_reads(node)]:  # a Loop body's reads count as the Loop's
                if isinstance(t, gs.Variable) and t.name:
                    self.last_use[t.name] = max(self.last_use.get(t.name, -1), i)

    def live(self, cut: int) -> set[str]:
        """Tensors produced before node ``cut`` and read at or after it (or graph outputs)."""
        return {t for t, p in self.produced.items() if p < cut and self.last_use.get(t, -1) >= cut}


def run_segment(
    graph: gs.Graph,
    values: dict[str, Array],
    outputs: Iterable[str],
    *,
    provider: str,
    batch_size: int,
    exact: bool = False,
    store: Store | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Array], str | None]:
    """Compute ``outputs`` from the cached ``values`` (all samples) with the nodes in between.

    With ``exact`` every run has exactly ``batch_size`` samples (a graph that fixes its batch): a short
    last chunk is padded with copies of its last sample, dropped from the results. The new arrays come from
    ``store`` (in RAM up to its budget, then on disk), or are plain numpy arrays without one. ``on_chunk(done,
    total)`` is called after each chunk of samples.
    Returns the new arrays and the execution provider that ran (None when nothing had to run).
    """
    outputs = sorted(set(outputs))
    if not outputs:
        return {}, None
    chunks, ran = run_cut(cut_graph(graph, values, outputs), values, provider=provider, batch_size=batch_size,
                          exact=exact)
    n = len(next(iter(values.values())))
    result: dict[str, Array] = {}
    start = 0
    for m, arrays in chunks:
        for name, array in arrays.items():
            if not _batched(array, m):
                raise AnalysisError(f"{no_batch_axis(name, array.shape, m)} but is cached across layers: this graph "
                                    "cannot be pruned cut by cut yet")
            if name not in result:
                shape = (n, *array.shape[1:])
                result[name] = np.empty(shape, array.dtype) if store is None else store.empty(shape, array.dtype)
            result[name][start : start + m] = array
        start += m
        if on_chunk is not None:
            on_chunk(start, n)
    return result, ran


def batchless(graph: gs.Graph, values: dict[str, Array], outputs: Iterable[str], *, provider: str, batch_size: int,
              exact: bool = False) -> dict[str, list[int]]:
    """The tensors among ``outputs`` that ``run_segment`` would refuse to cache (no samples on their first axis once
    ``cut_graph`` has moved a time-major batch there), with their shape, from one run of ``batch_size`` samples."""
    outputs = sorted(set(outputs) - set(values))
    if not outputs:
        return {}
    chunks, _ = run_cut(cut_graph(graph, values, outputs), values, provider=provider, batch_size=batch_size,
                        exact=exact)
    m, arrays = next(iter(chunks))
    return {name: list(a.shape) for name, a in arrays.items() if not _batched(a, m)}


def no_batch_axis(name: str, shape: Iterable[int], samples: int) -> str:
    """Why tensor ``name`` cannot be cached: the start of the message ``run_segment`` and ``batchless``'s users give."""
    return (f"tensor {name} has no batch axis (shape {list(shape)} for a batch of {samples}; computed from the batch "
            "size?)")


def _batched(array: np.ndarray, samples: int) -> bool:
    """Whether ``array`` carries ``samples`` samples on its first axis (what the cache holds)."""
    return array.ndim > 0 and len(array) == samples


def cut_graph(graph: gs.Graph, values: dict[str, Array], outputs: Iterable[str]) -> gs.Graph:
    """A copy of the nodes of ``graph`` that compute ``outputs`` (sorted) from the tensors ``values`` names.

    The cache holds every tensor samples first: a tensor with its batch on another axis (time-major, e.g. an
    RNN's ``[T, N, C]``) enters through a Transpose from that order and leaves through one to it; a tensor that
    folds k rows a sample into its first axis (``sample_rows``: a vision transformer's patches, ``[k·N, T, C]``) is
    held ``[N, k, T, C]``, through a Reshape each way."""
    symbol, batch = batch_symbol(graph), graph_batch(graph)
    g = _needed(graph, values, outputs).copy()
    tensors = g.tensors()
    inputs = []
    for name in values:
        if name not in tensors:
            continue
        tensor = tensors[name]
        tensor.inputs.clear()
        array = values[name]
        axis = batch_axis(tensor, symbol)
        if tensor.shape is not None and array.ndim == len(tensor.shape) + 1:
            tensor = _samples_apart(g, tensor, array.shape[1:], entering=True)
        elif axis:
            tensor = _samples_first(g, tensor, axis, entering=True)
        tensor.dtype, tensor.shape = array.dtype, ["N", *array.shape[1:]]
        inputs.append(tensor)
    g.inputs = inputs
    g.outputs = []
    for name in sorted(set(outputs)):
        tensor = tensors[name]
        axis, rows = batch_axis(tensor, symbol), sample_rows(tensor, batch)
        if rows > 1:
            tensor = _samples_apart(g, tensor, (rows, *tensor.shape[1:]), entering=False)
        elif axis:
            tensor = _samples_first(g, tensor, axis, entering=False)
        if tensor.dtype is None:
            tensor.dtype = np.float32
        g.outputs.append(tensor)
    g.cleanup(remove_unused_graph_inputs=True, recurse_subgraphs=False)  # bodies keep their inputs
    return g.toposort(recurse_subgraphs=False)


def settle(graph: gs.Graph, values: dict[str, Array], changing: Collection[str], *, provider: str, batch_size: int,
           exact: bool = False) -> dict[str, Array]:
    """The tensors ``graph`` (a ``cut_graph`` on ``values``) must be fed when only the nodes named ``changing`` and
    those that read them give something new from run to run: the tensors of ``values`` those nodes read, and the ones
    the other nodes give them (or give as graph outputs), computed here once. ``cut_graph(graph, settled, outputs)``
    then runs only what changes: a detector's other heads, a network's other branches, are not run again for every
    candidate. ``values`` itself where every node changes, or where a settled tensor has no batch axis to cache."""
    readers: dict[str, list[gs.Node]] = {}
    for node in graph.nodes:
        for t in {t.name for t in [*node.inputs, *outer_reads(node)] if t.name}:
            readers.setdefault(t, []).append(node)
    moving: set[int] = set()
    names = set(changing)
    stack = [n for n in graph.nodes if n.name in names]
    while stack:
        node = stack.pop()
        if id(node) not in moving:
            moving.add(id(node))
            stack.extend(r for t in node.outputs for r in readers.get(t.name, []))
    if len(moving) == len(graph.nodes):
        return values
    read = {t.name for n in graph.nodes if id(n) in moving for t in [*n.inputs, *outer_reads(n)] if t.name}
    given = {t.name for n in graph.nodes if id(n) not in moving for t in n.outputs}
    settled = sorted(given & (read | {t.name for t in graph.outputs}))
    try:
        computed, _ = run_segment(graph, values, settled, provider=provider, batch_size=batch_size, exact=exact)
    except AnalysisError:  # a tensor without a batch axis: run the whole cut every time, as before
        return values
    kept = read | {t.name for t in graph.outputs}
    return {**{k: v for k, v in values.items() if k in kept}, **computed}


def _needed(graph: gs.Graph, values: dict[str, Array], outputs: Iterable[str]) -> gs.Graph:
    """A graph (sharing ``graph``'s nodes, not to be changed) of the nodes that compute ``outputs`` from ``values``
    in ``graph``'s order, the outputs that are values themselves as its inputs: copying it costs what the cut needs,
    not what the whole graph holds."""
    producer = {t.name: node for node in graph.nodes for t in node.outputs}
    wanted = set(outputs)
    need: set[int] = set()
    stack, seen = list(wanted), set()
    while stack:
        name = stack.pop()
        if name in seen or name in values:
            continue
        seen.add(name)
        node = producer.get(name)
        if node is not None and id(node) not in need:
            need.add(id(node))
            stack.extend(t.name for t in [*node.inputs, *outer_reads(node)] if t.name)
    nodes = [n for n in graph.nodes if id(n) in need]
    tensors = graph.tensors()
    return gs.Graph(nodes=nodes, inputs=[tensors[n] for n in sorted(wanted) if n in values],
                    outputs=[tensors[n] for n in sorted(wanted)], name=graph.name, opset=graph.opset,
                    import_domains=graph.import_domains, functions=graph.functions, ir_version=graph.ir_version)


def _samples_first(g: gs.Graph, native: gs.Tensor, axis: int, entering: bool) -> gs.Tensor:
    """A new tensor under ``native``'s name holding it with its batch axis ``axis`` moved first, joined to it by a
    Transpose (from the new tensor when the cut graph reads it, to it when the cut graph writes it); ``native``
    is renamed ``<name>.native``."""
    name = native.name
    outer = gs.Variable(name, dtype=native.dtype)
    native.name = f"{name}.native"
    to_first = [axis, *(i for i in range(len(native.shape)) if i != axis)]
    if entering:
        g.nodes.append(gs.Node("Transpose", f"{name}.to_native", {"perm": np.argsort(to_first).tolist()},
                               [outer], [native]))
    else:
        g.nodes.append(gs.Node("Transpose", f"{name}.samples_first", {"perm": to_first}, [native], [outer]))
    return outer


def cached_axis(array: Array, tensor: gs.Tensor, axis: int) -> int:
    """Where axis ``axis`` of graph tensor ``tensor`` sits in its cached ``array``: one further on where the cache
    holds its folded rows apart (``_samples_apart``)."""
    return axis + (array.ndim - len(tensor.shape) if tensor.shape is not None else 0)


def in_graph_layout(array: np.ndarray, rank: int) -> np.ndarray:
    """A cached ``array`` (or a range of its samples) in its graph tensor's layout, of ``rank`` dims: the rows held
    apart (``_samples_apart``) folded back into the first axis."""
    return array.reshape(-1, *array.shape[2:]) if array.ndim == rank + 1 else array


def _samples_apart(g: gs.Graph, native: gs.Tensor, per_sample: Iterable[int], entering: bool) -> gs.Tensor:
    """As ``_samples_first`` for a tensor that folds rows of each sample into its first axis: a Reshape between
    ``native`` (``[k·N, ...]``) and a new tensor under its name holding ``[N, *per_sample]`` (``per_sample`` =
    ``(k, ...)``). A graph that folds samples into an axis runs one sample at a time (``ir.probe.fixed_batch`` finds
    the fold), so the rows a run gives are its sample's."""
    name = native.name
    per_sample = [int(d) for d in per_sample]
    outer = gs.Variable(name, dtype=native.dtype)
    native.name = f"{name}.native"
    if entering:
        target = gs.Constant(f"{name}.to_native.shape", np.array([-1, *per_sample[1:]], np.int64))
        g.nodes.append(gs.Node("Reshape", f"{name}.to_native", inputs=[outer, target], outputs=[native]))
    else:
        target = gs.Constant(f"{name}.samples_apart.shape", np.array([-1, *per_sample], np.int64))
        g.nodes.append(gs.Node("Reshape", f"{name}.samples_apart", inputs=[native, target], outputs=[outer]))
    return outer


def batch_symbol(graph: gs.Graph) -> str | None:
    """The symbol of the graph inputs' dynamic batch dim, when they share one."""
    symbols = {t.shape[0] for t in graph.inputs if t.shape and isinstance(t.shape[0], str)}
    return symbols.pop() if len(symbols) == 1 else None


def batch_axis(tensor: gs.Tensor, symbol: str | None) -> int:
    """The axis of ``tensor`` that holds the batch: the one dim named ``symbol`` (shape inference and
    ``ir.shapes.fill_shapes_from_run``'s batch-1/batch-2 probe name it), else 0."""
    axes = [i for i, d in enumerate(tensor.shape or []) if symbol is not None and d == symbol]
    return axes[0] if len(axes) == 1 else 0


def run_cut(
    g: gs.Graph, values: dict[str, Array], *, provider: str, batch_size: int, exact: bool = False
) -> tuple[Iterator[tuple[int, dict[str, np.ndarray]]], str | None]:
    """Run a ``cut_graph`` on ``values`` chunk by chunk: (samples in the chunk, the outputs as the graph returns
    them) for each chunk of ``batch_size`` samples, and the execution provider. With ``exact`` a short last
    chunk is padded; an output whose leading axis is the padded batch has the extra samples dropped, any other
    output is as computed."""
    session, ran = graph_session(g, provider, arena=False)
    return run_chunks(session, [t.name for t in g.outputs], {t.name: values[t.name] for t in g.inputs}, batch_size,
                      exact), ran


def run_chunks(session: ort.InferenceSession, outputs: list[str], values: dict[str, Array], batch_size: int,
               exact: bool = False, constants: dict[str, np.ndarray] | None = None
               ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """``session``'s ``outputs`` on ``values`` (samples first) chunk by chunk, with ``constants`` fed unchanged to
    every run: (samples in the chunk, the outputs) per chunk of ``batch_size`` samples. With ``exact`` a short
    last chunk is padded with copies of its last sample; an output whose leading axis is the padded batch has the
    extra samples dropped, any other output is as computed."""
    n = len(next(iter(values.values())))
    for start in range(0, n, batch_size):
        feed = {name: v[start : start + batch_size] for name, v in values.items()}
        m = min(batch_size, n - start)
        padded = exact and m < batch_size
        if padded:
            feed = {k: np.concatenate([v, np.repeat(v[-1:], batch_size - m, axis=0)]) for k, v in feed.items()}
        arrays = session.run(outputs, {**feed, **(constants or {})})
        yield m, {name: array[:m] if padded and array.ndim and len(array) == batch_size else array
                  for name, array in zip(outputs, arrays)}
