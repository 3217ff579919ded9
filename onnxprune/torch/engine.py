"""An ONNX graph as a differentiable ``torch.nn.Module`` running the kernels of ``onnxprune.ops``.

Used where onnxruntime cannot help: gradients of the network's final discrepancy w.r.t. a per-channel mask (global
imitation), training the pruned model's weights (``recover``) and the user's own training loop (``to_torch``).

* ``TorchGraph(model, outputs=..., inputs_at=..., hooks=...)`` evaluates the graph (or only the part downstream of
  ``inputs_at``); float initializers are ``nn.Parameter``s (shape-like floats and BatchNormalization statistics are
  buffers), ``Constant`` nodes are buffers. The kernels live with the rest of each op's knowledge in
  ``onnxprune.ops``, keyed by the opset each starts at (``onnxprune.ops.kernel``: what they see, ``OpNode``).
* ``write_back(model, torch_graph)`` copies the (trained) tensors back into the initializers; ``writeback_error``
  and ``writeback_tolerance`` judge the written model against the torch one.

Semantics follow the ONNX spec as onnxruntime implements it, opsets 7-21 (where an attribute became an input, a
kernel per opset range, or one that reads either place).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxprune.ops  # noqa: F401  (registers the op families)
from onnxprune.errors import ModelError, UnsupportedOpError
from onnxprune.ops.registry import OpEntry, lookup
from onnxprune.ops.kernel import OpFn, OpNode, Tensor


def _tensor_from_proto(t: onnx.TensorProto, base_dir: str = "") -> Tensor:
    if t.data_type == TensorProto.BFLOAT16:
        arr = numpy_helper.to_array(t, base_dir).astype(np.float32)
        return torch.from_numpy(np.array(arr)).to(torch.bfloat16)
    arr = numpy_helper.to_array(t, base_dir)
    return torch.from_numpy(np.array(arr, copy=True))


def _parse_attr(a: onnx.AttributeProto) -> Any:
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, onnx.TensorProto):
        return _tensor_from_proto(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    return v


@dataclass
class _Step:
    fn: OpFn
    node: OpNode
    inputs: list[str]
    outputs: list[str]
    release: list[str] = field(default_factory=list)


def _sanitise(name: str) -> str:
    s = re.sub(r"\W", "_", name)
    if not s or s[0].isdigit():
        s = "t_" + s
    return s


def _opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 1


def _producers(graph: onnx.GraphProto) -> dict[str, int]:
    """Tensor name -> index of the node writing it."""
    return {o: i for i, n in enumerate(graph.node) for o in n.output if o}


def _needed(graph: onnx.GraphProto, producer: dict[str, int], inits: Mapping[str, Any], outputs: Sequence[str],
            stop: set[str]) -> tuple[set[int], set[str]]:
    """The nodes and graph inputs needed to compute ``outputs`` from ``stop`` (backwards from the outputs)."""
    needed_nodes: set[int] = set()
    needed_inputs: set[str] = set()
    stack = list(outputs)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in stop or name in inits:
            continue
        if name in producer:
            i = producer[name]
            if i not in needed_nodes:
                needed_nodes.add(i)
                stack.extend(graph.node[i].input)
            continue
        needed_inputs.add(name)
    return needed_nodes, needed_inputs


def _order(graph: onnx.GraphProto, needed: set[int], available: set[str]) -> list[int]:
    """A topological order of the ``needed`` nodes (stable w.r.t. file order)."""
    order: list[int] = []
    pending = sorted(needed)
    while pending:
        rest = []
        for i in pending:
            if all(t in available for t in graph.node[i].input):
                order.append(i)
                available.update(graph.node[i].output)
            else:
                rest.append(i)
        if len(rest) == len(pending):
            bad = graph.node[rest[0]]
            raise ModelError(
                f"node {bad.name!r} ({bad.op_type}) reads a tensor nothing produces (or the graph has a "
                "cycle): check the model with onnx.checker"
            )
        pending = rest
    return order


CONTROL_FLOW = frozenset({"Loop", "If", "Scan"})


def _unsupported(problems: dict[str, list[str]]) -> UnsupportedOpError:
    listed = "; ".join(
        f"{op} at node(s) {', '.join(repr(n) for n in names[:3])}{' ...' if len(names) > 3 else ''}"
        for op, names in problems.items()
    )
    ways = []
    if set(problems) & CONTROL_FLOW:
        ways.append("training (recover) needs the whole model in torch, and control flow (a decoder's loop) is not "
                    "run there: the compressed model is the result")
    if set(problems) - CONTROL_FLOW:
        ways.append("register a torch kernel for it in the op registry (onnxprune.ops.register), or "
                    "simplify/re-export the model without these ops")
    return UnsupportedOpError(f"the torch evaluator cannot run {len(problems)} op type(s) of this model: {listed}: "
                              f"{'; '.join(ways)}")


def _steps(graph: onnx.GraphProto, order: list[int], opset: int,
           inits: Mapping[str, Any]) -> tuple[list[_Step], dict[str, set[bool]]]:
    """The kernel call of each node in ``order``, and per initializer whether each read is a static slot;
    raises ``UnsupportedOpError`` listing every op that cannot be evaluated."""
    problems: dict[str, list[str]] = {}
    steps: list[_Step] = []
    used_inits: dict[str, set[bool]] = {}
    for i in order:
        p = graph.node[i]
        default = p.domain in ("", "ai.onnx")
        key = p.op_type if default else f"{p.domain}::{p.op_type}"
        node = OpNode(
            name=p.name or (p.output[0] if p.output else f"node{i}"),
            op_type=p.op_type,
            attrs={a.name: _parse_attr(a) for a in p.attribute},
            num_outputs=len(p.output),
        )
        entry: OpEntry | None = lookup(p.op_type) if default else None
        fn = entry.kernel(opset) if entry is not None else None
        if fn is None:
            problems.setdefault(key, []).append(node.name)
            continue
        reason = entry.check(node, p) if entry.check else None
        if reason:
            problems.setdefault(f"{key} ({reason})", []).append(node.name)
            continue
        for slot, name in enumerate(p.input):
            if name in inits:
                used_inits.setdefault(name, set()).add(slot in entry.static_inputs)
        steps.append(_Step(fn, node, list(p.input), list(p.output)))
    if problems:
        raise _unsupported(problems)
    return steps, used_inits


def _mark_releases(steps: list[_Step], keep: set[str]) -> None:
    """Free every intermediate after its last reader."""
    last: dict[str, int] = {}
    for k, step in enumerate(steps):
        for t in step.inputs:
            last[t] = k
        for t in step.outputs:
            last.setdefault(t, k)
    for t, k in last.items():
        if t and t not in keep:
            steps[k].release.append(t)


class TorchGraph(torch.nn.Module):
    """An ONNX graph as a ``torch.nn.Module`` (differentiable w.r.t. inputs, parameters and hooks).

    ``outputs``: tensor names to return (default: the graph outputs); any intermediate tensor works.
    ``inputs_at``: start evaluating from these intermediate tensors: only the sub-graph needed to
    compute ``outputs`` from them is kept; graph inputs that this sub-graph still reads (e.g. a
    shape branch from the image) remain inputs too. ``self.input_names`` is the resulting order of
    ``forward``'s positional arguments (``inputs_at`` first, then the graph inputs still needed).
    ``hooks``: ``{tensor_name: fn(tensor) -> tensor}`` applied the moment a tensor is produced (or
    fed, or read from an initializer); ``self.hooks`` may be changed between calls.
    ``return_dict``: forward returns ``{name: tensor}`` instead of a tuple in ``output_names`` order.

    Float initializers become ``nn.Parameter``s registered under sanitised names
    (``self.onnx_names`` maps attribute -> ONNX name, ``self.attr_names`` the reverse); a float
    initializer only read in a static slot (shape/scales/roi, Clip bounds, BatchNormalization
    mean/var) and every non-float one becomes a buffer, as do ``Constant`` node values. Unknown
    ops raise ``UnsupportedOpError`` at construction, listing all of them.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        outputs: Sequence[str] | None = None,
        inputs_at: Sequence[str] | None = None,
        hooks: Mapping[str, Callable[[Tensor], Tensor]] | None = None,
        *,
        return_dict: bool = False,
        base_dir: str = "",
    ) -> None:
        super().__init__()
        graph = model.graph
        self.return_dict = return_dict
        self.hooks: dict[str, Callable[[Tensor], Tensor]] = dict(hooks or {})
        self.onnx_names: dict[str, str] = {}
        self.attr_names: dict[str, str] = {}
        self._sources: dict[str, str] = {}  # ONNX tensor -> attribute (initializers, Constant outputs)
        self._steps: list[_Step] = []
        self._feeds: set[str] = set()
        inits = {t.name: t for t in graph.initializer}
        producer = _producers(graph)
        graph_inputs = [v.name for v in graph.input if v.name not in inits]
        self.output_names = list(outputs) if outputs is not None else [o.name for o in graph.output]
        feeds_at = list(inputs_at or [])
        known = set(producer) | set(inits) | set(graph_inputs)
        for name in [*self.output_names, *feeds_at, *self.hooks]:
            if name not in known:
                raise ModelError(
                    f"tensor {name!r} is not in the graph {graph.name!r}: name a graph input, an initializer "
                    "or a node output"
                )
        needed_nodes, needed_inputs = _needed(graph, producer, inits, self.output_names, set(feeds_at))
        self.input_names = feeds_at + [n for n in graph_inputs if n in needed_inputs]
        order = _order(graph, needed_nodes, set(self.input_names) | set(inits) | {""})
        steps, used_inits = _steps(graph, order, _opset(model), inits)
        for name in self.output_names + list(self.hooks):
            if name in inits:
                used_inits.setdefault(name, set()).add(False)
        self._steps = self._hold(steps, used_inits, inits, base_dir)
        _mark_releases(self._steps, set(self.output_names))
        self._feeds = set(self.input_names)

    def _hold(self, steps: list[_Step], used_inits: dict[str, set[bool]], inits: Mapping[str, onnx.TensorProto],
              base_dir: str) -> list[_Step]:
        """Initializers -> parameters / buffers; Constant nodes -> buffers (folded out of the steps, which
        are returned without them)."""
        for name, slots in used_inits.items():
            value = _tensor_from_proto(inits[name], base_dir)
            attr = self._unique_attr(_sanitise(name))
            if value.is_floating_point() and False in slots:
                self.register_parameter(attr, torch.nn.Parameter(value))
            else:
                self.register_buffer(attr, value)
            self.onnx_names[attr] = name
            self.attr_names[name] = attr
            self._sources[name] = attr
        kept: list[_Step] = []
        for step in steps:
            if step.node.op_type == "Constant":
                attr = self._unique_attr("const_" + _sanitise(step.outputs[0]))
                self.register_buffer(attr, step.fn(step.node, []).clone())
                self._sources[step.outputs[0]] = attr
            else:
                kept.append(step)
        return kept

    def _unique_attr(self, base: str) -> str:
        name, k = base, 0
        while hasattr(self, name):
            k += 1
            name = f"{base}_{k}"
        return name

    # ---------------------------------------------------------------- introspection

    def initializer(self, onnx_name: str) -> Tensor:
        """The parameter/buffer holding ONNX initializer ``onnx_name``."""
        return getattr(self, self.attr_names[onnx_name])

    def named_initializers(self) -> Iterator[tuple[str, Tensor]]:
        """``(onnx_name, tensor)`` for every initializer the evaluated sub-graph reads."""
        for onnx_name, attr in self.attr_names.items():
            yield onnx_name, getattr(self, attr)

    @property
    def op_types(self) -> list[str]:
        """Op types evaluated, in execution order (without folded Constants)."""
        return [s.node.op_type for s in self._steps]

    # ---------------------------------------------------------------- evaluation

    def _device(self) -> torch.device:
        for t in self.parameters():
            return t.device
        for t in self.buffers():
            return t.device
        return torch.device("cpu")

    def run(self, feeds: Mapping[str, Any]) -> dict[str, Tensor]:
        """Evaluate with ``feeds`` by name; returns ``{output_name: tensor}``."""
        missing = [n for n in self.input_names if n not in feeds]
        unknown = [n for n in feeds if n not in self._feeds]
        if missing or unknown:
            raise TypeError(
                f"TorchGraph expects inputs {self.input_names}; missing {missing}, unexpected {unknown}"
            )
        hooks = self.hooks
        env: dict[str, Tensor] = {}
        for name, value in feeds.items():
            t = value if isinstance(value, Tensor) else torch.as_tensor(value, device=self._device())
            env[name] = hooks[name](t) if name in hooks else t
        for name, attr in self._sources.items():
            if name not in env:
                t = getattr(self, attr)
                env[name] = hooks[name](t) if name in hooks else t
        for step in self._steps:
            args = [env[n] if n else None for n in step.inputs]
            try:
                result = step.fn(step.node, args)
            except UnsupportedOpError:
                raise
            except Exception as exc:  # add the node to torch's message
                shapes = [tuple(a.shape) if a is not None else None for a in args]
                raise RuntimeError(
                    f"evaluating node {step.node.name!r} ({step.node.op_type}) on inputs {shapes} failed: {exc}"
                ) from exc
            outs = [result] if isinstance(result, Tensor) else list(result)
            for name, t in zip(step.outputs, outs):
                if name and name not in self._feeds:
                    env[name] = hooks[name](t) if name in hooks else t
            for name in step.release:
                env.pop(name, None)
        return {name: env[name] for name in self.output_names}

    def forward(self, *args: Any, **named: Any) -> tuple[Tensor, ...] | dict[str, Tensor]:
        if len(args) > len(self.input_names):
            raise TypeError(f"TorchGraph takes {len(self.input_names)} inputs {self.input_names}, got {len(args)}")
        feeds = dict(zip(self.input_names, args))
        clash = set(feeds) & set(named)
        if clash:
            raise TypeError(f"input(s) {sorted(clash)} given both by position and by name")
        feeds.update(named)
        out = self.run(feeds)
        return out if self.return_dict else tuple(out[n] for n in self.output_names)


def write_back(model: onnx.ModelProto, torch_graph: TorchGraph, *, inplace: bool = False) -> onnx.ModelProto:
    """Copy ``torch_graph``'s parameters and buffers into the initializers of the same names
    (dtype and shape kept, nodes untouched); returns the model (a copy unless ``inplace``)."""
    out = model if inplace else _copy(model)
    inits = {t.name: t for t in out.graph.initializer}
    for onnx_name, tensor in torch_graph.named_initializers():
        proto = inits.get(onnx_name)
        if proto is None:
            raise ModelError(
                f"initializer {onnx_name!r} of the TorchGraph is not in the model: write back into the model "
                "the TorchGraph was built from"
            )
        dims = list(proto.dims)
        if list(tensor.shape) != dims:
            raise ModelError(
                f"initializer {onnx_name!r} has shape {dims} in the model but {list(tensor.shape)} in the "
                "TorchGraph: write_back cannot change shapes (rebuild the model instead)"
            )
        t = tensor.detach().to("cpu")
        if proto.data_type == TensorProto.BFLOAT16:
            new = helper.make_tensor(onnx_name, TensorProto.BFLOAT16, dims, t.float().reshape(-1).tolist())
        else:
            np_dtype = helper.tensor_dtype_to_np_dtype(proto.data_type)
            arr = t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()
            new = numpy_helper.from_array(arr.astype(np_dtype, copy=False), onnx_name)
        doc = proto.doc_string
        proto.CopyFrom(new)
        if doc:
            proto.doc_string = doc
    return out


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def device_of(net: torch.nn.Module) -> torch.device:
    """Where the net's weights live (CPU for a net without any)."""
    return next(iter([*net.parameters(), *net.buffers()]), torch.empty(0)).device


def writeback_tolerance(device: torch.device) -> float:
    """Largest relative difference allowed between onnxruntime on the written model and the trained
    torch weights: float32 kernels summing in other orders (~1e-6 on CPU), or cuDNN convolutions in
    TF32 (~1e-3) on CUDA. A weight left unwritten differs by what the training changed."""
    return 1e-4 if device.type == "cpu" else 1e-2


def writeback_error(written: np.ndarray, trained: np.ndarray) -> float:
    """The relative L2 difference of onnxruntime's output on the written model from the trained torch weights', what
    ``writeback_tolerance`` bounds."""
    written = written.astype(np.float64)
    return float(np.linalg.norm(written - trained) / max(np.linalg.norm(written), 1e-30))
