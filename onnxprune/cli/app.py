"""The typer app and what its commands share: one-line errors, flag values read by the app's own parser, outputs
checked before any work, reports written safely."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx_graphsurgeon.logger.logger as gs_logger
import onnxruntime
import torch
import typer
import typer.main
from rich.markup import escape

from onnxprune import api
from onnxprune.errors import OnnxPruneError
from onnxprune.fileio import atomic_write, check_output
from onnxprune.flags.declared import MACS_HELP
from onnxprune.tables import (err_console)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Channel pruning of ONNX CNNs without fine-tuning: greedy channel selection (group OMP by "
                       "default; the local and global imitation of Ye, Wu & Liu, NeurIPS 2020) and a least-squares "
                       "refit of the next layer. "
                  + MACS_HELP)
onnxruntime.set_default_logger_severity(3)  # constant folding's sessions warn about harmless graph rewrites
# graph-surgeon prints its warnings with print(): to stderr, so that stdout (`--json`) stays data
gs_logger.print = lambda *args, **kwargs: print(*args, **kwargs, file=sys.stderr)  # type: ignore[attr-defined]


def error_line(error: str | OnnxPruneError) -> str:
    """``error``'s message with the flag of the option at fault (the library names the option, not its flag)."""
    message = str(error)
    option = getattr(error, "option", None)
    if option and f"--{option.replace('_', '-')}" not in message:
        message += f" (--{option.replace('_', '-')})"
    return message


def fail(error: str | OnnxPruneError) -> None:
    """Print ``error`` as one line on stderr and exit 2."""
    err_console.print(f"[bold red]error:[/] {escape(error_line(error))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)



def flag_values(command: str, args: Sequence[str]) -> dict[str, Any]:
    """The values ``command`` receives for the command line ``args`` (its defaults where a flag is absent), keyed by
    its parameter names: how the benchmarks read a flag list without declaring the flags again."""
    click_command = typer.main.get_command(app).commands[command]
    with click_command.make_context(command, list(args)) as ctx:
        return {k: (list(v) or None) if isinstance(v, tuple) else v for k, v in ctx.params.items()}


def check_outputs(*outputs: tuple[Path | None, str], inputs: list[Path]) -> None:
    """Every output path the command will write, checked before any work (one-line error naming the flag)."""
    for path, flag in outputs:
        if path is not None:
            check_output(path, inputs, what=f"{flag} file")


def write_json(path: Path, data: dict) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(data, indent=2)))


def save(result: api.Result, output: Path, report: Path | None, refuse: list[Path]) -> None:
    """The model to ``output`` and, with ``report``, its JSON report."""
    result.save(output, refuse=refuse)
    if report is not None:
        write_json(report, result.to_dict())



def torch_threads() -> None:
    """Torch on every core the process may run on, unless OMP_NUM_THREADS sets its threads (torch's default may
    take fewer; the library leaves torch's global settings to its caller)."""
    if not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(len(os.sched_getaffinity(0)))


def main() -> None:  # pragma: no cover - called by onnxprune.__main__ (the console entry)
    app(prog_name="onnxprune")


