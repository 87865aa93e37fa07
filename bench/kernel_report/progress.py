"""Progress lines while the report works: compiling every kernel takes minutes (219 s measured on a
2-core machine) during which the report has nothing else to print."""

from __future__ import annotations

import sys
import threading
import time
from typing import Dict, Optional, TextIO

PROGRESS_EVERY_S = 15.0  # below the 20 s a reader should wait at most for a sign of life


class Progress:
    """Prints ``kernel_report: [N s] part: what it does; ...`` to ``stream`` every ``interval``
    seconds while inside ``with``, from a background thread. The parts of the report say what they
    are doing with :meth:`update` (a part that ends calls :meth:`finish`)."""

    def __init__(self, interval: float = PROGRESS_EVERY_S, stream: Optional[TextIO] = None) -> None:
        if not interval > 0:
            raise ValueError(f"the progress interval must be a positive number of seconds, got {interval!r}")
        self.interval = interval
        self.stream = stream
        self._parts: Dict[str, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = time.monotonic()

    def update(self, part: str, text: str) -> None:
        with self._lock:
            self._parts[part] = text

    def finish(self, part: str) -> None:
        with self._lock:
            self._parts.pop(part, None)

    def line(self) -> str:
        with self._lock:
            doing = "; ".join(f"{part}: {text}" for part, text in self._parts.items()) or "finishing"
        return f"kernel_report: [{time.monotonic() - self._start:.0f} s] {doing}"

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            print(self.line(), file=self.stream or sys.stderr, flush=True)

    def __enter__(self) -> "Progress":
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._beat, name="kernel-report-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
