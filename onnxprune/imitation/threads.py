"""Torch's thread pool beside onnxruntime's and the BLAS threads: small torch work on one thread."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread inside: small operations (a step's batched k×k factorisations, a detector's decoding of
    a few thousand anchors) gain nothing from more, and torch's pool waking between them competes with the BLAS
    threads of the next product and with onnxruntime's threads still spinning after a run (on 2 cores, OMP ran
    1.7× slower with torch on 2 threads; YOLOX's probes' decoding took 2.9 s instead of 0.5 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
