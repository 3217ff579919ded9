"""The documents and the archive of measurements: links that resolve, outputs only, files a reader can open."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
CODE = (".py", ".patch", ".diff", ".sh")


def _tracked(under: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z", str(under)], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.stdout.split("\0") if p]


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((RESULTS / "notebook").glob("*.md"))]


def test_every_relative_link_of_the_docs_and_the_notebook_resolves() -> None:
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in _pages()
              for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)\s]*)?\)", page.read_text())
              if not re.match(r"[a-z]+:", target) and not (page.parent / target).exists()]
    assert not broken, broken


def test_the_archive_holds_outputs_only_under_names_without_spaces() -> None:
    files = _tracked(RESULTS)
    assert files, "no results tracked"
    assert not [f for f in files if f.suffix in CODE], "code belongs in benchmarks/, not among its outputs"
    assert not [f for f in files if " " in f.name]


def test_no_notebook_file_is_over_a_thousand_lines_and_the_index_names_each() -> None:
    notebook = sorted((RESULTS / "notebook").glob("*.md"))
    index = (RESULTS / "notebook" / "README.md").read_text()
    assert len(notebook) > 1
    for page in notebook:
        assert len(page.read_text().splitlines()) <= 1000, page.name
        assert page.name == "README.md" or f"]({page.name})" in index, page.name
