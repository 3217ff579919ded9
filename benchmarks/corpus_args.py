"""The command line the corpus export scripts share (no import beyond the standard library: ``corpus_ultralytics.py``
runs in a venv of its own)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path

MADE = Path(__file__).resolve().parent / "results" / "third_party_models" / "made"  # where third_party.py looks


def selected(doc: str, names: Iterable[str], extra: Callable[[argparse.ArgumentParser], object] | None = None
             ) -> tuple[Path, list[str], argparse.Namespace]:
    """The output folder (created), the export file names the command line asks for (``--only``, else all) and
    all its arguments (``extra`` adds a script's own to the parser)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=MADE)
    parser.add_argument("--only", default="", help="comma-separated export file names (default: all)")
    if extra:
        extra(parser)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args.out, [n for n in names if not args.only or n in args.only.split(",")], args
