"""Command line: ``onnxprune analyze | compress | sweep | recover | eval | bench | export | quantize``.

The flags are declared in ``onnxprune.flags.declared``; ``onnxprune.flags.jobs`` builds the API's objects from
their values; ``onnxprune.tables`` prints the results. ``app`` holds the typer app; ``prune`` and ``deploy`` register its commands."""

# the commands register on ``app`` as their modules load, in the order --help lists them
from onnxprune.cli import prune  # noqa: F401, I001
from onnxprune.cli import deploy  # noqa: F401
from onnxprune.cli.app import app, error_line, flag_values, main, torch_threads

__all__ = ["app", "error_line", "flag_values", "main", "torch_threads"]
