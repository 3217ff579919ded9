"""Cut a pruned model into segments that end where it must agree with its teacher.

An anchor is a tensor that the student and the teacher both compute, with the same name and
shape, and that is the ONLY tensor alive at some point of the student's node order: everything
after it depends on the input through it alone. Between two consecutive anchors lies a segment;
recovery trains each segment whose weights differ from the teacher's to reproduce the teacher's
tensor at its end from the student's tensor at its start.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_graphsurgeon as gs

from onnxprune.errors import ModelError
from onnxprune.ir.cuts import Liveness


@dataclass
class Segment:
    """Nodes between ``start`` (tensors fed) and ``end`` (tensors to match) of the student."""

    start: list[str]
    end: list[str]
    nodes: list[str]
    changed: list[str]  # float initializers read here whose shape or values differ from the teacher's
    weights: list[str]  # every float initializer read here

    @property
    def trainable(self) -> bool:
        return bool(self.changed)


def _shapes(graph: gs.Graph) -> dict[str, tuple]:
    return {name: tuple(t.shape) for name, t in graph.tensors().items()
            if isinstance(t, gs.Variable) and t.shape is not None}


def _weights(graph: gs.Graph) -> dict[str, np.ndarray]:
    return {name: np.asarray(t.values) for name, t in graph.tensors().items()
            if isinstance(t, gs.Constant) and np.issubdtype(np.asarray(t.values).dtype, np.floating)}


def check_pair(student: gs.Graph, teacher: gs.Graph) -> None:
    """ModelError unless the student has the teacher's inputs and outputs (names and shapes)."""
    for kind in ("inputs", "outputs"):
        s = [(t.name, tuple(t.shape or ())) for t in getattr(student, kind)]
        t = [(t.name, tuple(t.shape or ())) for t in getattr(teacher, kind)]
        if s != t:
            raise ModelError(f"the student's graph {kind} {s} differ from the teacher's {t}: recovery needs the "
                             "teacher the student was pruned from (same input and output names and shapes)")


def find_segments(student: gs.Graph, teacher: gs.Graph) -> list[Segment]:
    """Segments of ``student`` (toposorted) between anchors shared with ``teacher``, in order."""
    check_pair(student, teacher)
    ops = {n.name: n.op for n in teacher.nodes}
    # the pruning names a node it adds after the teacher's node it serves: a refit MatMul's ``.bias_add``, a pruned
    # LayerNormalization's ``.pad<n>`` and ``.keep<n>``
    foreign = [n.name for n in student.nodes if ops.get(n.name) != n.op and n.name.rpartition(".")[0] not in ops]
    if foreign:
        raise ModelError(f"{len(foreign)} node(s) of the student, e.g. {foreign[0]!r}, are not in the teacher: "
                         "recovery needs the teacher the student was pruned from (pruning keeps node names)")
    s_shapes, t_shapes = _shapes(student), _shapes(teacher)
    t_weights = _weights(teacher)
    live = Liveness(student)
    cuts: list[tuple[int, list[str]]] = [(0, [t.name for t in student.inputs])]
    for pos in range(1, len(student.nodes)):
        alive = live.live(pos)
        if len(alive) == 1:
            (name,) = alive
            if name in t_shapes and s_shapes.get(name) == t_shapes[name]:
                cuts.append((pos, [name]))
    cuts.append((len(student.nodes), [t.name for t in student.outputs]))
    segments = []
    for (a, start), (b, end) in zip(cuts, cuts[1:]):
        if a == b:
            continue
        nodes = student.nodes[a:b]
        weights, changed = set(), set()
        for node in nodes:
            for t in node.inputs:
                if isinstance(t, gs.Constant) and np.issubdtype(np.asarray(t.values).dtype, np.floating):
                    weights.add(t.name)
                    ref = t_weights.get(t.name)
                    if ref is None or ref.shape != np.shape(t.values) or not np.array_equal(ref, t.values):
                        changed.add(t.name)
        segments.append(Segment(start, end, [n.name for n in nodes], sorted(changed), sorted(weights)))
    if not any(s.trainable for s in segments):
        raise ModelError("the student's weights equal the teacher's: nothing to recover (was it pruned from a "
                         "different model?)")
    return segments


def windows(segments: list[Segment], k: int) -> list[Segment]:
    """The segments with every run of ``k`` changed ones (and the unchanged ones between them) made one, ending at
    the last one's end: the block stage trains a window's weights together, so a segment can correct what the
    next one cannot represent. The segments after the last changed one stay as they are."""
    changed = [i for i, s in enumerate(segments) if s.trainable]
    if k <= 1 or not changed:
        return list(segments)
    groups: list[list[Segment]] = [[]]
    for i, seg in enumerate(segments[: changed[-1] + 1]):
        groups[-1].append(seg)
        if seg.trainable and sum(s.trainable for s in groups[-1]) == k and i != changed[-1]:
            groups.append([])
    merged = [Segment(g[0].start, g[-1].end, [n for s in g for n in s.nodes],
                      sorted({w for s in g for w in s.changed}), sorted({w for s in g for w in s.weights}))
              for g in groups]
    return merged + segments[changed[-1] + 1 :]


def head_start(segments: list[Segment], n: int, changed_only: bool) -> int | None:
    """The index of the first segment of a distilled head: the last ``n`` segments, reaching back to the last
    segment that holds a weight to train (a changed one with ``changed_only``) when those hold none (a Softmax or
    an Identity at the end); None when ``n`` asks for the whole model (0, or as many segments as there are)."""
    if not 0 < n < len(segments):
        return None
    holding = [i for i, s in enumerate(segments) if (s.changed if changed_only else s.weights)]
    return min(len(segments) - n, holding[-1])
