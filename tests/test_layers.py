"""The house's floors, checked over the imports: no circle, no arrow from a lower floor to a higher one, no
arrow between the rooms of one floor, and no file in ``onnxprune/`` over ``MAX_LINES`` lines.

Every ``import`` counts, wherever it stands (in a function, under ``TYPE_CHECKING``): a lazy import is still
the arrow it draws. The floors, top first; the units on one floor stand side by side and import nothing of
each other. A module belongs to the longest unit its name starts with; the package's ``__init__`` is its own unit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "onnxprune"
MAX_LINES = 450
FLOORS: list[tuple[str, ...]] = [
    ("onnxprune", "onnxprune.__main__"),  # the package's front door: the API re-exported; `python -m onnxprune`
    ("onnxprune.cli",),  # the command line
    ("onnxprune.flags", "onnxprune.tables"),  # flags declared, their values -> the API's objects; what the CLI prints
    ("onnxprune.sweep",),  # many budgets over one calibration and one set of probes, judged and timed
    ("onnxprune.api",),  # load / compress / recover / evaluate / bench / export
    ("onnxprune.pipeline", "onnxprune.recovery", "onnxprune.deploy"),  # the pruning loop (its pre-flight included);
    # training; after pruning: fidelity to another model, INT8, TensorRT, timing
    ("onnxprune.strategies",),  # budgets, selectors, allocators, reconstructions
    ("onnxprune.core",),  # what strategies see of a run (Context), statistics, reconstruction on a graph
    ("onnxprune.budget", "onnxprune.torch"),  # MAC and latency costs of widths, widths within a budget; a graph as
    # a torch module (the engine recover trains with), to and from the user's torch, the manifest
    ("onnxprune.normal", "onnxprune.passes", "onnxprune.tasks", "onnxprune.fileio"),  # the normal form in and out;
    # the pruning's surgery; output decoding; safe writes
    ("onnxprune.analysis", "onnxprune.runtime", "onnxprune.calib"),  # groups and MACs; timed runs, huge pages; samples
    ("onnxprune.ops",),  # the op registry
    ("onnxprune.ir",),  # loading, shapes, graph helpers; onnxruntime sessions and runs, cut by cut into the store
    ("onnxprune.imitation", "onnxprune.errors", "onnxprune.progress"),  # numerical kernels; errors; heartbeat
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The ``onnxprune`` modules ``name`` imports (a ``from X import y`` of a submodule y counts as X.y)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "onnxprune")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            if base.split(".")[0] != "onnxprune":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield full if full in modules else base


def _unit(name: str) -> str:
    units = [u for floor in FLOORS for u in floor if name == u or (u != "onnxprune" and name.startswith(u + "."))]
    if not units:
        raise AssertionError(f"{name} stands on no floor: add its package to FLOORS in {__file__}")
    return max(units, key=len)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: set(_imports(name, path, modules)) for name, path in modules.items()}


def _floor(unit: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if unit in floor)


def test_every_arrow_points_down() -> None:
    wrong = []
    for name, targets in _graph().items():
        mine = _unit(name)
        for target in targets:
            theirs = _unit(target)
            if theirs == mine:
                continue
            if _floor(theirs) < _floor(mine):
                wrong.append(f"{name} imports {target}: {theirs} stands above {mine}")
            elif _floor(theirs) == _floor(mine):
                wrong.append(f"{name} imports {target}: {mine} and {theirs} stand side by side on one floor")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_circle_among_modules() -> None:
    graph = _graph()
    cycles = _cycles({k: {t for t in v if t in graph} for k, v in graph.items()})
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or of one that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycles_are_found() -> None:
    """The checker itself: a circle of three and a self-import are found, a chain is not."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"a"}}) == [["a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("unit", ["onnxprune.ir", "onnxprune.ops", "onnxprune.core"])
def test_unit_lookup(unit: str) -> None:
    assert _unit(unit + ".x") == unit
    with pytest.raises(AssertionError, match="stands on no floor"):
        _unit("onnxprune.something_new")  # a new top-level module must be given its floor


def test_no_file_over_the_limit() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
