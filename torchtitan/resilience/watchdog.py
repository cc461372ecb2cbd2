"""The hang watchdog: evidence of where every rank is when a training step takes far too long.

A daemon thread per rank watches the step in progress. When it has run longer than
``hang_watchdog_factor`` times the median of the steps so far (and at least
``hang_watchdog_floor_seconds``), the thread writes the Python stack of every thread of this rank
(``faulthandler``) to ``{dump_folder}/hangs/step-N/rank_R.txt`` and logs one line pointing at it,
once per step. A rank waiting in a collective for a stopped or slow peer stalls in the same step,
so every live rank writes its file: read side by side, they show who waits where. Nothing is
interrupted: if the step completes, training goes on (and a line says how long it took); if a
collective never returns, ``comm.train_timeout_seconds`` ends the run.

The median is over the completed steps of this run except the first (compilation, first
loads). Whatever the factor and floor, the watchdog fires before a collective of the step can time
out: at the latest after ``SHARE_OF_TIMEOUT`` of the collective timeout in force
(``comm.init_timeout_seconds`` during the run's first step, ``comm.train_timeout_seconds`` after),
so every rank waiting on a frozen peer has its stacks on disk when the timeout ends it, and that
error line names the folder (:attr:`HangWatchdog.written`). Before two steps have completed, that
bound is the only limit. Checkpoint saves and validation are not
watched: they are not training steps, and a long save is not a hang. (A step does wait for a
background save's copy of the weights before its optimizer update, ``async_with_pinned_mem``:
that wait is watched, and a very slow one shows in the stacks as ``wait_for_staging``.)
"""

from __future__ import annotations

import faulthandler
import statistics
import threading
import time
from pathlib import Path

from torchtitan.observability.log import logger

__all__ = ["HangWatchdog"]

_HISTORY = 100  # the median is over the last this many steps
# a step has run this share of the collective timeout: its collectives may be about to time out
SHARE_OF_TIMEOUT = 0.75


class HangWatchdog:
    """``begin(step)`` before a training step, ``end(step)`` after it; ``close()`` at the end
    (or use it as a context manager). ``factor`` 0: off (no thread). ``timeouts_s``: the
    collective timeouts (during the run's first step, after it), which the limit stays under."""

    written: Path | None = None  # the folder of the last stacks this process wrote

    def __init__(
        self,
        dump_folder: str,
        rank: int,
        *,
        factor: float,
        floor_s: float,
        poll_s: float = 1.0,
        timeouts_s: tuple[float, float] = (float("inf"), float("inf")),
    ) -> None:
        self.folder, self.rank = Path(dump_folder) / "hangs", rank
        self.factor, self.floor_s, self.poll_s = factor, floor_s, poll_s
        self.timeouts_s = timeouts_s
        self.durations: list[float] = []  # the last steps' seconds, the run's first not among them
        self._first_done = False
        self._step: int | None = None
        self._started = 0.0
        self._reported: int | None = None  # the step whose stacks were written
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if factor > 0:
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def before_step(self, step: int) -> None:
        with self._lock:
            self._step, self._started = step, time.monotonic()

    def after_step(self, step: int) -> None:
        with self._lock:
            took = time.monotonic() - self._started
            self._step = None
            reported = self._reported == step
            if self._first_done:  # the first step (compilation, first loads) is not typical
                self.durations = (self.durations + [took])[-_HISTORY:]
            self._first_done = True
        if reported:
            logger.warning(
                f"Hang watchdog: step {step} completed after {took:.1f}s; training goes on"
            )

    def limit(self) -> float | None:
        """Seconds a step may take before the stacks are written: ``factor`` x the median step
        (at least the floor), but never as long as a collective may wait; None when neither
        bounds it (no median yet, no timeout)."""
        timeout = self.timeouts_s[1] if self._first_done else self.timeouts_s[0]
        bound = SHARE_OF_TIMEOUT * timeout
        if not self.durations:
            return None if bound == float("inf") else bound
        return min(bound, max(self.floor_s, self.factor * statistics.median(self.durations)))

    def __enter__(self) -> HangWatchdog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop watching (also when a step raised: its teardown is not a hang)."""
        with self._lock:
            self._step = None
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.poll_s)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                step, elapsed, limit = self._step, time.monotonic() - self._started, self.limit()
                due = step is not None and limit is not None and elapsed > limit
                if due and self._reported != step:
                    self._reported = step
                else:
                    due = False
            if due:
                self._dump(step, elapsed, limit)

    def _dump(self, step: int, elapsed: float, limit: float) -> None:
        path = self.folder / f"step-{step}" / f"rank_{self.rank}.txt"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(
                    f"rank {self.rank}, step {step}: running for {elapsed:.1f}s, over the "
                    f"watchdog's limit of {limit:.1f}s\n"
                )
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:
            logger.warning(
                f"Hang watchdog: step {step} has run {elapsed:.0f}s; could not write {path}: {e}"
            )
            return
        HangWatchdog.written = path.parent
        logger.warning(
            f"Hang watchdog: step {step} has run {elapsed:.0f}s (limit {limit:.0f}s); "
            f"every thread's stack of rank {self.rank} is in {path}"
        )
