"""The global-imitation objectives of one channel group, evaluated on the downstream graph.

``ConsumerDownstream`` (what ``--method global`` and ``auto`` use) runs the part of the graph after a cut in
onnxruntime with the group's consumers' weights and biases as graph inputs: each candidate (the consumers
refitted on a candidate support) is one run of the same session on the chosen samples, scored by
``output_discrepancy`` against the original network's outputs.

``DownstreamObjective`` (the paper's parametrisation, used by the benchmarks that redo its figures) runs only the part of the ONNX graph after a cut (``TorchGraph`` with
``inputs_at`` = the tensors alive there, cached for every calibration sample), with the group's
channels scaled in flight: channel i of every masked tensor is multiplied by N·a_i (the paper's
fold; a = 1/N is the original network). The discrepancy D(a) to the original network's final
outputs is

* ``loss="kl"``: KL(softmax(original) || softmax(pruned)) per sample for 2-D outputs (logits),
  mean squared error for any other output;
* ``loss="mse"``: mean squared error (over the non-batch elements) for every output;

summed over outputs and averaged over the samples. ``losses(A, step)`` and ``grad(a, step)`` are
the callbacks of ``onnxprune.imitation.global_.greedy_global``: every step draws one seeded
mini-batch (shared by all candidates of the step and its gradient); K candidates × B samples are
stacked into one forward pass (chunked to at most ``max_rows`` rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import torch

from onnxprune.analysis import consumers
from onnxprune.errors import CalibrationError, ModelError
from onnxprune.runtime.ort import make_session
from onnxprune.runtime.segments import cut_graph, run_chunks
from onnxprune.runtime.store import Array, DiskArray
from onnxprune.runtime.torch_eval import TorchGraph
from onnxprune.sensitivity import output_discrepancy

LOSSES = ("kl", "mse")
MEMORY_BYTES = 2 << 30
"""Default activation budget of one forward pass (sets ``max_rows``)."""
ACTIVATION_FACTOR = 16
"""Assumed peak activation bytes of the downstream graph per byte of cut tensors (a heuristic:
MobileNet's 6x expansions with two tensors alive, plus slack)."""

__all__ = ["LOSSES", "ConsumerDownstream", "DownstreamObjective"]


class ConsumerDownstream:
    """The network's final-output discrepancy when the consumers ``nodes`` take candidate weights.

    graph: the network as pruned so far; at_cut: the tensors alive at the cut, (samples, ...) each;
    reference: the original network's outputs on the same samples (output name -> array). ``exact_batch``:
    the batch a graph that fixes it runs at (short runs are padded), else None.
    """

    def __init__(self, graph: gs.Graph, at_cut: Mapping[str, Array], nodes: Sequence[str],
                 reference: Mapping[str, Array], *, provider: str, exact_batch: int | None = None) -> None:
        cut = cut_graph(graph, dict(at_cut), reference)
        mine = {n.name: n for n in cut.nodes}
        missing = [name for name in nodes if name not in mine]
        if missing:
            raise ModelError(f"consumer(s) {missing} do not run after the cut: the network's outputs do not read them")
        for name in nodes:  # a bias everywhere (a MatMul's is an Add), so that every candidate can set one
            lin = consumers.matrix(mine[name])
            consumers.write(cut, mine[name], consumers.Linear(lin.weight, np.ones_like(lin.bias), lin.k))
        cut.cleanup(recurse_subgraphs=False).toposort(recurse_subgraphs=False)
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
        self.session, self.provider = make_session(gs.export_onnx(cut), provider, arena=False)
        self._outputs = [t.name for t in cut.outputs]
        self._at_cut = {t.name: at_cut[t.name] for t in cut.inputs if t.name in at_cut}
        self._reference = reference
        self.exact_batch = exact_batch
        self.n_samples = len(next(iter(reference.values())))

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

    def samples(self, idx: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The tensors at the cut and the reference outputs of samples ``idx`` (sorted), read once for many
        candidates."""
        return ({k: np.ascontiguousarray(v[idx]) for k, v in self._at_cut.items()},
                {k: np.asarray(v[idx]) for k, v in self._reference.items()})

    def losses(self, candidates: Sequence[Sequence[consumers.Linear]],
               samples: tuple[dict[str, np.ndarray], dict[str, np.ndarray]]) -> np.ndarray:
        """The discrepancy of each candidate on ``samples`` (from ``samples()``), (K,) float64."""
        values, reference = samples
        n = len(next(iter(reference.values())))
        rows = self.exact_batch or n
        ref = [{k: v[s : s + rows] for k, v in reference.items()} for s in range(0, n, rows)]
        out = np.empty(len(candidates))
        for i, linears in enumerate(candidates):
            chunks = run_chunks(self.session, self._outputs, values, rows, self.exact_batch is not None,
                                self.weights(linears))
            out[i] = output_discrepancy(ref, [arrays for _, arrays in chunks])
        return out


class DownstreamObjective:
    """D(a) of one channel group from the cached tensors at its cut.

    model: the network (the pruned prefix may differ from the original; only the part after the
    cut is evaluated). cut_values: every tensor alive at the cut, (samples, ...) each.
    channel_tensors: (tensor name, channel axis) pairs the mask multiplies (the consumers'
    inputs; a tensor read by other nodes too is scaled for those as well). An axis of size
    N·R (e.g. a Flatten before a Gemm) takes each channel's factor on R consecutive entries.
    reference: the original network's outputs for the same samples (graph output name ->
    array); these are the outputs evaluated. n_channels: N, by default the axis size of the
    first channel tensor (give it when that tensor is flattened).
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        cut_values: Mapping[str, np.ndarray],
        channel_tensors: Sequence[tuple[str, int]],
        reference: Mapping[str, np.ndarray],
        *,
        loss: str = "kl",
        batch_size: int | None = 64,
        seed: int = 0,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        n_channels: int | None = None,
        max_rows: int | None = None,
    ) -> None:
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} not in {LOSSES}")
        if not cut_values:
            raise ValueError("cut_values is empty: give the tensors alive at the cut")
        if not channel_tensors:
            raise ValueError("channel_tensors is empty: name the tensor(s) whose channels the mask scales")
        if not reference:
            raise ValueError("reference is empty: give the original network's outputs")
        counts = {name: len(v) for name, v in {**cut_values, **reference}.items()}
        if len(set(counts.values())) != 1:
            raise CalibrationError(
                f"cut values and reference outputs hold different sample counts {counts}: cache them "
                "from the same calibration samples"
            )
        self.n_samples = next(iter(counts.values()))
        if self.n_samples == 0:
            raise CalibrationError("no calibration samples at the cut")
        self.loss = loss
        self.batch_size = self.n_samples if batch_size is None else max(1, min(int(batch_size), self.n_samples))
        self.seed = int(seed)
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.channel_tensors = [(str(t), int(ax)) for t, ax in channel_tensors]
        for name, axis in self.channel_tensors:
            if axis == 0:
                raise ValueError(f"channel axis of {name!r} is 0, the sample axis: give the channel axis")

        self._cut = {k: v if isinstance(v, DiskArray) else np.asarray(v) for k, v in cut_values.items()}
        self.output_names = list(reference)
        self.graph = TorchGraph(
            model,
            outputs=self.output_names,
            inputs_at=list(self._cut),
            hooks={name: self._hook(name, axis) for name, axis in self.channel_tensors},
        )
        missing = [n for n in self.graph.input_names if n not in self._cut]
        if missing:
            raise ModelError(
                f"the graph after the cut also reads {missing}, which are not among the cut values: "
                "cache every tensor alive at the cut (Liveness.live)"
            )
        self.graph.requires_grad_(False)
        self.graph.to(device=self.device, dtype=dtype)
        # the network's outputs, small next to the cut tensors: held whole (v[:] reads a spilled one back)
        self._ref = {k: torch.as_tensor(np.asarray(v[:])).to(self.device, dtype) for k, v in reference.items()}
        self._logp = {k: torch.log_softmax(v, dim=-1) for k, v in self._ref.items() if self._kl(v)}

        # N and the per-tensor repeats: from the cut values, else from one probing sample
        self._mask: torch.Tensor | None = None
        self._sizes: dict[str, int] = {
            name: int(self._cut[name].shape[axis]) for name, axis in self.channel_tensors if name in self._cut
        }
        self._fired: set[str] = set()
        self._probing = True
        try:
            with torch.no_grad():
                out = self.graph.run(self._feeds(np.arange(1)))
        finally:
            self._probing = False
        unused = [name for name, _ in self.channel_tensors if name not in self._fired]
        if unused:
            raise ModelError(
                f"channel tensor(s) {unused} are not evaluated after the cut: name the consumers' inputs "
                "downstream of the cut values"
            )
        for k, v in out.items():
            if tuple(v.shape[1:]) != tuple(self._ref[k].shape[1:]):
                raise ModelError(
                    f"output {k!r} has per-sample shape {tuple(v.shape[1:])} after the cut but the "
                    f"reference has {tuple(self._ref[k].shape[1:])}: give the reference of the same outputs"
                )
        first = self._sizes[self.channel_tensors[0][0]]
        self.n_channels = int(n_channels) if n_channels is not None else first
        self._repeat: dict[str, int] = {}
        for name, size in self._sizes.items():
            if size % self.n_channels:
                raise ValueError(
                    f"channel axis of {name!r} has {size} entries, not a multiple of {self.n_channels} channels"
                )
            self._repeat[name] = size // self.n_channels

        if max_rows is None:
            per_sample = sum(v[:1].nbytes for v in self._cut.values()) * torch.finfo(dtype).bits // 32
            max_rows = MEMORY_BYTES // max(per_sample * ACTIVATION_FACTOR, 1)
        self.max_rows = max(int(max_rows), 1)
        self._batch_cache: tuple[int, tuple[np.ndarray, dict[str, torch.Tensor]]] | None = None

    # ------------------------------------------------------------------ internals

    def _kl(self, ref: torch.Tensor) -> bool:
        return self.loss == "kl" and ref.dim() == 2

    def _hook(self, name: str, axis: int):
        def hook(t: torch.Tensor) -> torch.Tensor:
            ax = axis + t.dim() if axis < 0 else axis
            if self._probing:
                self._fired.add(name)
                self._sizes.setdefault(name, int(t.shape[ax]))
                return t
            m = self._mask  # (rows or 1, N)
            rep = self._repeat[name]
            if rep > 1:
                m = m.repeat_interleave(rep, dim=1)
            shape = [1] * t.dim()
            shape[0], shape[ax] = m.shape[0], m.shape[1]
            return t * m.reshape(shape).to(t.dtype)

        return hook

    def batch(self, step: int) -> np.ndarray:
        """Sample indices (sorted) of ``step``'s mini-batch: all samples when the batch covers
        them, else ``batch_size`` drawn without replacement, seeded by (seed, step)."""
        if self.batch_size >= self.n_samples:
            return np.arange(self.n_samples)
        rng = np.random.default_rng([self.seed, int(step)])
        return np.sort(rng.choice(self.n_samples, self.batch_size, replace=False))

    def _feeds(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        out = {}
        for name, v in self._cut.items():
            t = torch.as_tensor(np.ascontiguousarray(v[idx]))
            out[name] = t.to(self.device, self.dtype) if t.is_floating_point() else t.to(self.device)
        return out

    def _step_feeds(self, step: int) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        if self._batch_cache is None or self._batch_cache[0] != step:
            idx = self.batch(step)
            self._batch_cache = (step, (idx, self._feeds(idx)))
        return self._batch_cache[1]

    def _per_sample(self, out: Mapping[str, torch.Tensor], idx: torch.Tensor, k: int) -> torch.Tensor:
        """Per-sample discrepancy (k, B) of outputs stacked candidate-major (k·B rows)."""
        total = None
        for name, y in out.items():
            y = y.reshape(k, len(idx), *y.shape[1:])
            ref = self._ref[name][idx]
            if name in self._logp:
                logp = self._logp[name][idx]
                d = (logp.exp() * (logp - torch.log_softmax(y, dim=-1))).sum(-1)
            else:
                d = (y - ref).pow(2).reshape(k, len(idx), -1).mean(-1)
            total = d if total is None else total + d
        return total

    def _forward(self, feeds: Mapping[str, torch.Tensor], masks: torch.Tensor) -> dict[str, torch.Tensor]:
        """Outputs for the K masks (K, N) on the B samples of ``feeds``, rows candidate-major."""
        k = masks.shape[0]
        b = len(next(iter(feeds.values())))
        if k == 1:
            self._mask = masks
            stacked = feeds
        else:
            self._mask = masks.repeat_interleave(b, dim=0)
            stacked = {n: t.repeat(k, *([1] * (t.dim() - 1))) for n, t in feeds.items()}
        try:
            return self.graph.run(stacked)
        finally:
            self._mask = None

    # ------------------------------------------------------------------ callbacks

    def losses(self, candidates: np.ndarray, step: int) -> np.ndarray:
        """D of each candidate weight vector (K, N) on ``step``'s mini-batch, (K,) float64."""
        a = np.atleast_2d(np.asarray(candidates, dtype=np.float64))
        if a.shape[1] != self.n_channels:
            raise ValueError(f"candidates have {a.shape[1]} weights, the group {self.n_channels} channels")
        idx, feeds = self._step_feeds(step)
        tidx = torch.as_tensor(idx, device=self.device)
        masks = torch.as_tensor(a * self.n_channels).to(self.device, self.dtype)
        per = max(self.max_rows // len(idx), 1)
        out = np.empty(len(a))
        with torch.no_grad():
            for s in range(0, len(a), per):
                m = masks[s : s + per]
                d = self._per_sample(self._forward(feeds, m), tidx, len(m))
                out[s : s + len(m)] = d.mean(1).double().cpu().numpy()
        return out

    def grad(self, a: np.ndarray, step: int) -> np.ndarray:
        """r = ∂D/∂b at b = 0 for the mask N·(a + b), on ``step``'s mini-batch, (N,) float64."""
        a = np.asarray(a, dtype=np.float64).reshape(-1)
        idx, feeds = self._step_feeds(step)
        b = torch.zeros(self.n_channels, device=self.device, dtype=self.dtype, requires_grad=True)
        base = torch.as_tensor(a).to(self.device, self.dtype)
        n = len(idx)
        with torch.enable_grad():
            for s in range(0, n, self.max_rows):
                part = {k: v[s : s + self.max_rows] for k, v in feeds.items()}
                rows = len(next(iter(part.values())))
                mask = (self.n_channels * (base + b))[None, :]
                tidx = torch.as_tensor(idx[s : s + rows], device=self.device)
                d = self._per_sample(self._forward(part, mask), tidx, 1)
                (d.sum() / n).backward()
        return b.grad.double().cpu().numpy()

    def full_loss(self, a: np.ndarray) -> float:
        """D(a) on all samples (for reporting)."""
        masks = torch.as_tensor(np.asarray(a, dtype=np.float64).reshape(1, -1) * self.n_channels).to(
            self.device, self.dtype)
        total = 0.0
        with torch.no_grad():
            for s in range(0, self.n_samples, self.max_rows):
                idx = np.arange(s, min(s + self.max_rows, self.n_samples))
                d = self._per_sample(self._forward(self._feeds(idx), masks), torch.as_tensor(idx, device=self.device), 1)
                total += float(d.sum().double())
        return total / self.n_samples
