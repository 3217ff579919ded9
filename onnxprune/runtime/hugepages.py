"""Transparent huge pages for the C library's allocator in the long commands (``compress``, ``recover``, ``sweep``).

glibc hands every freed block over 32 MB back to the kernel, which zeroes its pages again at the next allocation of
that size. ``compress`` allocates tens of gigabytes of such temporaries (im2col patches, GEMM operands, onnxruntime's
activations) and spent a third of its CPU time in the kernel doing so. With the tunable ``glibc.malloc.hugetlb=1``
(glibc 2.35 or later, transparent huge pages on "always" or "madvise") those maps take 2 MB pages: MobileNetV2 at
245M on the 500 dev photos 39.6 s -> 28.3 s, a U²-Net-like export 37.3 s -> 29.8 s, page faults 30-50× fewer, peak
memory up to 5% higher (benchmarks/results/notebook/third-party.md, "Huge pages"). glibc reads its tunables when a process
starts, so the command line restarts itself once with it set; a ``GLIBC_TUNABLES`` already in the environment
(empty: glibc's defaults) is left as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
LONG_COMMANDS = frozenset({"compress", "recover", "sweep"})
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def restart_environment(argv: Sequence[str], environ: Mapping[str, str], libc: str | None, thp: str | None
                        ) -> dict[str, str] | None:
    """The environment to restart ``argv`` with, or None: not a long command, ``GLIBC_TUNABLES`` set already, a C
    library other than glibc 2.35+ (``libc``: ``os.confstr("CS_GNU_LIBC_VERSION")``, "glibc 2.36"), or transparent
    huge pages off (``thp``: the kernel's setting, "always [madvise] never")."""
    command = next((a for a in argv[1:] if not a.startswith("-")), None)
    if command not in LONG_COMMANDS or "GLIBC_TUNABLES" in environ or not libc or not thp:
        return None
    name, _, version = libc.partition(" ")
    try:
        numbers = tuple(int(p) for p in version.split(".")[:2])
    except ValueError:
        return None
    if name != "glibc" or numbers < (2, 35) or not ("[always]" in thp or "[madvise]" in thp):
        return None
    return {**environ, "GLIBC_TUNABLES": TUNABLE}


def restart_with_huge_pages() -> None:
    """Restart this command line (``python -m onnxprune ...``, same process id) with ``TUNABLE`` where
    ``restart_environment`` says so; otherwise return."""
    if sys.platform != "linux":
        return
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION")
        thp = _THP.read_text()
    except (OSError, ValueError):
        return
    env = restart_environment(sys.argv, os.environ, libc, thp)
    if env is not None and sys.executable:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execve(sys.executable, [sys.executable, "-m", "onnxprune", *sys.argv[1:]], env)
        except OSError:  # an interpreter that cannot be started again: run as we are, with glibc's defaults
            return
