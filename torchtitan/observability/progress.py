"""A progress bar for long preparation steps (building a dataset, converting checkpoints).

On a terminal it redraws one line, ``what [#######.............]  35%  7/20  3.1s``; when the
stream is not a terminal (a log file, a CI console) it prints a plain line at every tenth and at
the end instead, so that logs stay readable.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

WIDTH = 24


class Progress:
    """``Progress(what, total)``; call ``update(done)`` as work finishes (``done`` up to ``total``)."""

    def __init__(self, what: str, total: int, stream: TextIO | None = None) -> None:
        self.what, self.total = what, max(1, total)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._t0 = time.perf_counter()
        self._last_tenth = 0

    def update(self, done: int) -> None:
        done = min(done, self.total)
        elapsed = time.perf_counter() - self._t0
        if self.tty:
            filled = WIDTH * done // self.total
            bar = "#" * filled + "." * (WIDTH - filled)
            end = "\n" if done == self.total else ""
            self.stream.write(
                f"\r{self.what} [{bar}] {100 * done // self.total:3d}%  {done}/{self.total}  "
                f"{elapsed:.1f}s{end}"
            )
            self.stream.flush()
            return
        tenth = 10 * done // self.total
        if tenth != self._last_tenth and (tenth > self._last_tenth or done == self.total):
            self._last_tenth = tenth
            print(
                f"{self.what}: {done}/{self.total} ({elapsed:.1f}s)", file=self.stream, flush=True
            )

    def __call__(self, done: int, total: int | None = None) -> None:
        """The ``progress(done, total)`` callback form used by the checkpoint readers."""
        if total is not None:
            self.total = max(1, total)
        self.update(done)
