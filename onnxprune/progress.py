"""Progress of long work where no terminal shows a bar: plain lines, at least every few seconds.

A log, a CI job or a notebook's subprocess has no terminal, and a bar drawn there is either silent or noise.
``Heartbeat`` writes one line per change of step (at most one every ``min_gap`` seconds) and, from a thread,
one every ``interval`` seconds while a step runs long, so that a hang can be told from slow progress:

    [compress 1:23] probing model.22/cv3.0 (12/66) · about 2:41 left in this phase
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

INTERVAL = 10.0  # seconds between lines while nothing changes (the promise is one at least every 30 s)
MIN_GAP = 2.0  # seconds between lines when steps change fast


def clock_text(seconds: float) -> str:
    """``seconds`` as m:ss (h:mm:ss past an hour)."""
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Heartbeat:
    """``update(done, total, label)`` as work advances; lines go to ``stream`` while the context is open.

    The phase is the label's first word ("probing", "pruning", ...); the estimate of what is left is the
    phase's time so far per step done, times the steps left in it."""

    def __init__(self, command: str, stream: TextIO | None = None, interval: float | None = None,
                 min_gap: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.command = command
        self.stream = stream
        self.interval = INTERVAL if interval is None else interval
        self.min_gap = MIN_GAP if min_gap is None else min_gap
        self.clock = clock
        self.start = clock()
        self.done, self.total, self.label = 0, 0, ""
        self.phase, self.phase_start = "", self.start
        self.last_line = self.start  # the first line after min_gap: a job refused within it prints its error alone
        self.shown = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def update(self, done: int, total: int | None, label: str) -> None:
        """The work is at step ``done`` of ``total`` (None: unknown), doing ``label``."""
        with self._lock:
            now = self.clock()
            phase = label.split(" ", 1)[0] if label else ""
            if phase != self.phase:
                self.phase, self.phase_start = phase, now
            self.done, self.total, self.label = done, total or 0, label
            if self._step() != self.shown and now - self.last_line >= self.min_gap:
                self._write(now)

    def line(self, now: float | None = None) -> str:
        """The line describing where the work stands."""
        now = self.clock() if now is None else now
        text = f"[{self.command} {clock_text(now - self.start)}] {self.label or 'starting'}"
        if self.total:
            text += f" ({self.done}/{self.total})"
            if 0 < self.done < self.total:
                left = (now - self.phase_start) / self.done * (self.total - self.done)
                text += f" · about {clock_text(left)} left in this phase"
        return text

    def beat(self) -> None:
        """Write the current line if ``interval`` seconds passed since the last one (the thread calls this)."""
        with self._lock:
            now = self.clock()
            if now - self.last_line >= self.interval:
                self._write(now)

    def _step(self) -> str:
        return f"{self.label.split(':', 1)[0]}|{self.done}|{self.total}"

    def _write(self, now: float) -> None:
        stream = self.stream or sys.stderr
        stream.write(self.line(now) + "\n")
        stream.flush()
        self.last_line, self.shown = now, self._step()

    def __enter__(self) -> Heartbeat:
        self._thread = threading.Thread(target=self._run, name="onnxprune-progress", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(min(self.interval, 1.0)):
            self.beat()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc and exc[0] is not None:
            return  # the error says why it stopped, on a line of its own
        with self._lock:
            stream = self.stream or sys.stderr
            stream.write(f"[{self.command} {clock_text(self.clock() - self.start)}] done\n")
            stream.flush()
