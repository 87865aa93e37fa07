"""Progress lines at a bounded interval for the long commands (``tpo-kernels check``, ``bench``).

A single step of those commands (one path of the check at a large shape, one benchmark
measurement) can run for minutes inside one kernel call or a subprocess, so per-step lines alone
leave long silences. :class:`Heartbeat` owns the command's line printer: every line goes through
:meth:`Heartbeat.say`, and a helper thread adds ``... <what runs now>: still running, N s`` whenever
``interval`` seconds pass without a line. The thread only reads a clock and prints; the work stays on
the calling thread (torch releases the GIL in its kernels, and the interpreter switches threads
every few milliseconds in Python code, so the line comes on time either way).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

# Seconds without a line after which the heartbeat prints one. The commands promise a line at
# least every 20 s; 15 s leaves room for a line printed late by a busy machine.
PROGRESS_INTERVAL_S = 15.0


class Heartbeat:
    """``with Heartbeat(print_line) as beat:``: ``beat.say(line)`` prints through ``print_line``;
    ``beat.stage(text)`` names the work that runs now (what a heartbeat line reports, with the
    seconds since the stage began). ``interval``: None takes :data:`PROGRESS_INTERVAL_S` as it is
    when the block is entered."""

    def __init__(self, print_line: Callable[[str], None], interval: Optional[float] = None, indent: str = "    "):
        self._print_line = print_line
        self._interval = interval
        self._indent = indent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._last_line = self._stage_began = time.monotonic()
        self._stage = "working"

    @property
    def interval(self) -> float:
        return PROGRESS_INTERVAL_S if self._interval is None else self._interval

    def say(self, line: str) -> None:
        with self._lock:
            self._print_line(line)
            self._last_line = time.monotonic()

    def stage(self, text: str) -> None:
        with self._lock:
            self._stage, self._stage_began = text, time.monotonic()

    def __enter__(self) -> "Heartbeat":
        if not self.interval > 0:
            raise ValueError(f"the progress interval must be > 0 seconds, got {self.interval!r}")
        self._interval = self.interval
        with self._lock:
            self._last_line = self._stage_began = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tpo-kernels-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        wait = self._interval
        while not self._stop.wait(wait):
            with self._lock:
                now = time.monotonic()
                quiet = now - self._last_line
                if quiet >= self._interval:
                    self._print_line(f"{self._indent}... {self._stage}: still running, {now - self._stage_began:.0f} s")
                    self._last_line, quiet = now, 0.0
            wait = max(self._interval - quiet, 0.01)
