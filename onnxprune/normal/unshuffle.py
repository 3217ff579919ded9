"""Pass: channel permutations (ShuffleNet's channel shuffle) moved into the weights that read them.

A channel shuffle (``Reshape`` to ``[N, g, C/g, ...]``, ``Transpose``, ``Reshape`` back) or a channel-axis ``Gather``
of a permutation sends channel ``p[i]`` of its input to channel ``i``: the channels of one conv land every g-th channel,
which no channel range describes, so the analysis stopped there. This pass writes the same function without the
permutation: it moves forward through channel-wise ops (their per-channel constants permuted), into a ``Concat`` (which
then joins the unpermuted inputs), through ``Split`` / ``Slice`` (each piece a selection of channels, written as a
``Concat`` of ``Slice``s of the tensors that produce them, in their order, then a permutation of that), into a later
permutation (composed), and ends in the weight columns of the Conv / Gemm / MatMul that reads it. ShuffleNetV2's units
become concatenations of ranges of their branches' outputs, which prune. A permutation read by anything else (a graph
output, an op with other computed inputs, an op not known to be channel-wise) stays there as a ``Gather``.
"""

from __future__ import annotations

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.analysis.ops import role_of
from onnxprune.ir.graph import const_value, export_model, read_instead, static_shape
from onnxprune.ir.load import import_graph
from onnxprune.ir.rewrite import only_reader
from onnxprune.ops.roles import Channelwise, Consumer

Source = tuple[gs.Tensor, int]  # (the tensor a channel is read from, its index there)


def unshuffle(graph: gs.Graph) -> gs.Graph:
    """Replace every channel shuffle by a channel-axis ``Gather`` and move every permutation ``Gather`` forward until
    the weights that read it absorb it (see the module's docstring).

    Returns a new graph: ``graph`` is imported again with its shape computations folded first (the channel split
    before a shuffle is a ``Slice`` whose bounds torch computes from the input's ``Shape``)."""
    graph = import_graph(export_model(graph))
    writer, outputs = _Writer(graph), {t.name for t in graph.outputs}
    for node in [n for n in graph.nodes if n.op == "Reshape"]:
        found = _shuffle(node, outputs)
        if found is not None:
            writer.take_over(found[1], writer.gather(node.inputs[0], found[0], node.name))
    for _ in range(4 * len(graph.nodes) + 8):  # each round moves every permutation on by one node: a bound, not a loop
        moved = False
        for node in [n for n in graph.nodes if _permutation(n) is not None]:
            moved = writer.push(node) or moved
        graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
        if not moved:
            break
    _flatten_concats(graph, outputs)
    return graph.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)


def _flatten_concats(graph: gs.Graph, outputs: set[str]) -> None:
    """Splice a channel-axis Concat read only by another into it (the pass writes a Concat of its Concats)."""
    for node in [n for n in graph.nodes if n.op == "Concat" and _on_channels(n)]:
        inputs = []
        for t in node.inputs:
            inner = t.inputs[0] if len(t.inputs) == 1 else None
            spliced = inner is not None and inner.op == "Concat" and _on_channels(inner) and only_reader(t, outputs)
            inputs.extend(inner.inputs if spliced else [t])
        if len(inputs) != len(node.inputs):
            node.inputs.clear()
            node.inputs.extend(inputs)


def has_channel_permutation(graph: gs.Graph) -> bool:
    """Whether ``graph`` has a channel-axis permutation ``Gather``, or what may be a channel shuffle: a ``Reshape`` to
    rank r + 1, a ``Transpose`` of axes 1 and 2, a ``Reshape`` to rank r (the shapes ``unshuffle`` needs to tell may
    be known only after folding)."""
    outputs = {t.name for t in graph.outputs}
    for node in graph.nodes:
        if _permutation(node) is not None:
            return True
        chain = _chain(node, outputs)
        if chain is None:
            continue
        perm = list(chain[0].attrs.get("perm", []))
        shapes = [static_shape(t) for t in (node.outputs[0], chain[1].outputs[0])]
        if None not in shapes and len(shapes[0]) == len(shapes[1]) + 1 and perm[:3] == [0, 2, 1] \
                and perm[3:] == list(range(3, len(perm))):
            return True
    return False


def _channels(tensor: gs.Tensor) -> int | None:
    shape = static_shape(tensor)
    return shape[1] if shape is not None and len(shape) >= 2 and isinstance(shape[1], int) else None


def _chain(reshape: gs.Node, outputs: set[str]) -> tuple[gs.Node, gs.Node] | None:
    """The ``Transpose`` and the ``Reshape`` after it where ``reshape`` (a Reshape) is the first of such a chain, each
    tensor between them read only by the next node (none of the graph ``outputs``), else None."""
    if reshape.op != "Reshape":
        return None
    transpose = only_reader(reshape.outputs[0], outputs)
    back = None if transpose is None or transpose.op != "Transpose" else only_reader(transpose.outputs[0], outputs)
    return None if back is None or back.op != "Reshape" else (transpose, back)


def _shuffle(reshape: gs.Node, outputs: set[str]) -> tuple[np.ndarray, gs.Tensor] | None:
    """The permutation a ``Reshape`` → ``Transpose`` → ``Reshape`` chain (``_chain``) from ``reshape`` computes and the
    chain's output, where it gives back its input's shape ``[N, C, ...]`` (static but for N) with only the channels
    moved (none of them in place of another's entries), the batch axis kept first; else None."""
    chain = _chain(reshape, outputs)
    if chain is None:
        return None
    transpose, back = chain
    shapes = [static_shape(t) for t in (reshape.inputs[0], reshape.outputs[0], back.outputs[0])]
    perm = list(transpose.attrs.get("perm", []))
    if any(s is None or None in s[1:] or len(s) < 2 for s in shapes) or shapes[0] != shapes[2] or perm[:1] != [0]:
        return None
    (n, c, *rest), middle = shapes[0], shapes[1]
    if middle[0] != n or c == 1:
        return None
    probe = np.broadcast_to(np.arange(c).reshape(1, c, *[1] * len(rest)), (1, c, *rest))
    moved = probe.reshape(1, *middle[1:]).transpose(perm).reshape(1, c, *rest)
    p = moved.reshape(c, -1)[:, 0]
    if not (moved.reshape(c, -1) == p[:, None]).all() or not np.array_equal(np.sort(p), np.arange(c)):
        return None
    return None if np.array_equal(p, np.arange(c)) else (p, back.outputs[0])


def _permutation(node: gs.Node) -> np.ndarray | None:
    """The indices of a Gather on axis 1 of a computed tensor of rank >= 3 that permute all its channels, else None."""
    if node.op != "Gather" or int(node.attrs.get("axis", 0)) != 1 or isinstance(node.inputs[0], gs.Constant):
        return None
    index, c, shape = const_value(node.inputs[1]), _channels(node.inputs[0]), static_shape(node.inputs[0])
    if index is None or c is None or index.ndim != 1 or len(shape) < 3:
        return None
    p = index.astype(np.int64) % c
    return p if len(p) == c and np.array_equal(np.sort(p), np.arange(c)) else None


def _variable(like: gs.Tensor, channels: int, name: str) -> gs.Variable:
    shape = list(like.shape) if like.shape is not None else None
    if shape is not None:
        shape[1] = channels
    return gs.Variable(name, dtype=like.dtype, shape=shape)


def _sources(tensor: gs.Tensor) -> list[Source]:
    """Where each channel of ``tensor`` is read from, through channel-axis Concat, Split and Slice (step 1)."""
    c = _channels(tensor)
    writer = tensor.inputs[0] if len(tensor.inputs) == 1 else None
    if c is None or writer is None:
        return [(tensor, i) for i in range(c or 0)]
    if writer.op == "Concat" and _on_channels(writer) and all(_channels(t) is not None for t in writer.inputs):
        return [s for t in writer.inputs for s in _sources(t)]
    if writer.op == "Split" and _on_channels(writer):
        sizes = [_channels(t) for t in writer.outputs]
        if None not in sizes:
            k = writer.outputs.index(tensor)
            start = sum(sizes[:k])
            return _sources(writer.inputs[0])[start:start + c]
    bounds = _range(writer)
    if bounds is not None:
        return _sources(writer.inputs[0])[bounds[0]:bounds[1]]
    return [(tensor, i) for i in range(c)]


def _on_channels(node: gs.Node) -> bool:
    """Whether a Concat's or Split's axis is 1."""
    shape = static_shape(node.outputs[0])
    return shape is not None and int(node.attrs.get("axis", 0)) % len(shape) == 1


def _range(node: gs.Node) -> tuple[int, int] | None:
    """[start, end) of an opset-10 ``Slice`` of the channel axis alone with step 1 and constant bounds, else None."""
    if node.op != "Slice" or len(node.inputs) < 4:
        return None
    params = [const_value(t) for t in node.inputs[1:]]
    c = _channels(node.inputs[0])
    if c is None or any(v is None or v.size != 1 for v in params) or int(params[2][0]) != 1:
        return None
    if len(params) > 3 and int(params[3][0]) != 1:
        return None
    start, end, _ = slice(int(params[0][0]), int(params[1][0])).indices(c)
    return start, end


class _Writer:
    """Writes the pass's nodes into ``graph``, each under a name of its own (``base.unshuffleN``)."""

    def __init__(self, graph: gs.Graph) -> None:
        self.graph, self.count = graph, 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}.unshuffle{self.count}"

    def node(self, op: str, base: str, inputs: list[gs.Tensor], like: gs.Tensor, channels: int,
             attrs: dict | None = None, domain: str | None = None) -> gs.Variable:
        """A new ``op`` node reading ``inputs``; its output is shaped like ``like`` with ``channels`` channels."""
        name = self.name(base)
        out = _variable(like, channels, f"{name}.out")
        self.graph.nodes.append(gs.Node(op, name, attrs or {}, inputs=inputs, outputs=[out], domain=domain))
        return out

    def constant(self, base: str, values: np.ndarray) -> gs.Constant:
        return gs.Constant(self.name(base), np.ascontiguousarray(values))

    def gather(self, x: gs.Tensor, index: np.ndarray, base: str) -> gs.Variable:
        return self.node("Gather", base, [x, self.constant(f"{base}.index", np.asarray(index, np.int64))], x,
                         len(index), {"axis": 1})

    def slice(self, x: gs.Tensor, start: int, end: int, base: str) -> gs.Variable:
        params = [self.constant(f"{base}.{what}", np.array([v], np.int64))
                  for what, v in (("starts", start), ("ends", end), ("axes", 1), ("steps", 1))]
        return self.node("Slice", base, [x, *params], x, end - start)

    def take_over(self, old: gs.Tensor, new: gs.Tensor) -> None:
        """Make every reader of ``old`` read ``new`` instead (an Identity writes ``old`` where it is a graph
        output)."""
        read_instead(old, new)
        if any(t is old for t in self.graph.outputs):
            for writer in list(old.inputs):
                writer.outputs[writer.outputs.index(old)] = _variable(old, _channels(old) or 0,
                                                                      self.name(f"{old.name}.before"))
            self.graph.nodes.append(gs.Node("Identity", self.name(old.name), inputs=[new], outputs=[old]))

    def selection(self, x: gs.Tensor, index: np.ndarray, base: str) -> gs.Tensor:
        """A tensor holding channels ``index`` of ``x`` (distinct): the ranges of the tensors they are read from
        (``_sources``), each a ``Slice``, joined by a ``Concat`` in the order ``x`` holds them, then a permutation
        ``Gather`` where ``index`` holds them in another order."""
        sources = _sources(x)
        if len(sources) != _channels(x) or len(set(index.tolist())) != len(index):
            return self.gather(x, index, base)
        rank = {(id(t), k): i for i, (t, k) in enumerate(sources)}
        wanted = sorted(index.tolist(), key=lambda i: rank[(id(sources[i][0]), sources[i][1])])
        runs: list[tuple[gs.Tensor, int, int]] = []
        for i in wanted:
            t, k = sources[i]
            if runs and runs[-1][0] is t and runs[-1][2] == k:
                runs[-1] = (t, runs[-1][1], k + 1)
            else:
                runs.append((t, k, k + 1))
        pieces = [t if (a, b) == (0, _channels(t)) else self.slice(t, a, b, base) for t, a, b in runs]
        joined = pieces[0] if len(pieces) == 1 else self.node("Concat", base, pieces, x, len(index), {"axis": 1})
        order = {i: j for j, i in enumerate(wanted)}
        p = np.array([order[i] for i in index.tolist()], np.int64)
        return joined if np.array_equal(p, np.arange(len(p))) else self.gather(joined, p, base)

    def push(self, gather: gs.Node) -> bool:
        """Move the permutation ``gather`` computes past each node that reads it where a rule below knows how;
        whether any did."""
        x, out, p = gather.inputs[0], gather.outputs[0], _permutation(gather)
        outputs = {t.name for t in self.graph.outputs}
        moved = False
        for reader in list(out.outputs):
            if reader not in self.graph.nodes:
                continue
            # a graph output keeps its channel order: a node that would write the permutation after it into one
            # (a channel-wise op, a Concat) leaves it before it
            ahead = not any(t.name in outputs for t in reader.outputs)
            then = _permutation(reader) if reader.inputs[0] is out else None
            if then is not None:
                self.take_over(reader.outputs[0], self.selection(x, p[then], reader.name))
            elif reader.op == "Split" and _on_channels(reader) and reader.inputs[0] is out and None not in [
                    _channels(t) for t in reader.outputs]:
                start = 0
                for piece in reader.outputs:
                    end = start + _channels(piece)
                    self.take_over(piece, self.selection(x, p[start:end], reader.name))
                    start = end
            elif _range(reader) is not None and reader.inputs[0] is out:
                a, b = _range(reader)
                self.take_over(reader.outputs[0], self.selection(x, p[a:b], reader.name))
            elif reader.op == "Concat" and ahead and _on_channels(reader) and None not in [
                    _channels(t) for t in reader.inputs]:
                index, start = [], 0
                for t in reader.inputs:
                    index.append(start + (p if t is out else np.arange(_channels(t))))
                    start += _channels(t)
                joined = self.node("Concat", reader.name, [x if t is out else t for t in reader.inputs],
                                   reader.outputs[0], start, {"axis": 1})
                self.take_over(reader.outputs[0], self.gather(joined, np.concatenate(index), reader.name))
            elif not self.absorb(reader, out, x, p, ahead):
                continue
            moved = True
        return moved

    def absorb(self, reader: gs.Node, out: gs.Tensor, x: gs.Tensor, p: np.ndarray, ahead: bool) -> bool:
        """Where ``reader`` mixes ``out``'s channels (a consumer) or maps them one to one with no other computed
        input, read ``x`` instead with its per-channel constants permuted back; a channel-wise op's output is then
        permuted by ``p`` after it, unless it is a graph output (``ahead`` False). Whether it did."""
        k = [i for i, t in enumerate(reader.inputs) if t is out]
        computed = [t for t in reader.inputs if not isinstance(t, gs.Constant) and t is not out and t.name]
        if len(k) != 1 or computed or len(reader.outputs) != 1:
            return False
        role = role_of(reader, ("in", k[0]), 1, 1, (0, len(p)))
        if isinstance(role, Channelwise):
            one_to_one = set(role.ports) == {("in", k[0]), ("out", 0)} and all(
                v == (1, 1) for v in role.ports.values()) and not any(role.frames.values()) and not role.resizes
            if not ahead or not one_to_one:
                return False
        elif not isinstance(role, Consumer):
            return False
        if any(site.node != reader.name for site in role.slices):
            return False
        inputs = list(reader.inputs)
        inputs[k[0]] = x
        inverse = np.argsort(p)
        for site in role.slices:
            values = np.asarray(inputs[site.input_index].values)
            order = (inverse[:, None] * site.repeat + np.arange(site.repeat)).ravel()
            inputs[site.input_index] = self.constant(inputs[site.input_index].name, np.take(values, order, site.axis))
        if isinstance(role, Consumer):
            for i, t in enumerate(inputs):
                reader.inputs[i] = t
            return True
        moved = self.node(reader.op, reader.name, inputs, reader.outputs[0], len(p), dict(reader.attrs),
                          reader.domain)
        self.take_over(reader.outputs[0], self.gather(moved, p, reader.name))
        return True
