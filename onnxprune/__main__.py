"""The command line (``onnxprune``, ``python -m onnxprune``): the long commands restart with huge pages first
(``runtime.hugepages``), before the package's heavy imports, then the typer app runs."""

from onnxprune.runtime.hugepages import restart_with_huge_pages


def main() -> None:
    restart_with_huge_pages()
    from onnxprune.cli import main as run  # torch, onnxruntime and the rest, in the process that runs the command

    run()


if __name__ == "__main__":
    main()
