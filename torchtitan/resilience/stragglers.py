"""The straggler report: which rank is slow, by how much, and whether it is compute or data.

In a synchronous job every rank's step takes the same wall time: the fast ranks wait for the slow
one inside the step's collectives. Wall time cannot name a straggler; what a rank does with its
time can. Each rank measures, over the steps of every ``metrics.log_freq`` interval:

- **busy time**: seconds the training thread was running on a CPU or runnable (waiting on a run
  queue for one), fields 1 and 2 of ``/proc/thread-self/schedstat`` (Linux). A rank waiting for
  its peers in a gloo collective sleeps, which is not counted; a rank starved of CPU by other
  work is runnable, which is. Without schedstat: ``time.thread_time()`` (CPU time only).
- **data wait**: wall seconds in ``next(data_iter)`` (measured by the training loop);
- **wall time** of the steps.

At each log step one ``all_gather`` of these three numbers (no collective with one rank or the
report off) gives every rank every rank's numbers; rank 0 logs one line when the busiest rank's
busy time is over ``resilience.straggler_threshold`` times the median, and every rank returns the
spread for TensorBoard / W&B (``stragglers/...``). The first step of a run (compilation, first
loads) and what happens between steps (logging, validation, checkpoint saves) are not counted.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from torchtitan.observability.log import logger

__all__ = ["StragglerReport", "busy_seconds", "straggler_line", "summarize"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


def busy_seconds(path: str = _SCHEDSTAT) -> float:
    """Seconds the calling thread (or the thread whose ``schedstat`` file ``path`` is) has been
    on a CPU or waiting on a run queue; ``time.thread_time()`` where there is no such file."""
    try:
        with open(path, "rb") as f:
            on_cpu, run_queue = f.read().split()[:2]
        return (int(on_cpu) + int(run_queue)) / 1e9
    except (OSError, ValueError):
        return time.thread_time()


def summarize(busy: list[float], data_wait: list[float]) -> dict[str, float]:
    """The spread over the ranks (index = rank) of one interval, for TensorBoard / W&B."""
    median = statistics.median(busy)
    slowest = max(range(len(busy)), key=lambda r: busy[r])
    return {
        "stragglers/busy_max_over_median": busy[slowest] / median if median > 0 else 1.0,
        "stragglers/busy_median_s": median,
        "stragglers/busy_max_s": busy[slowest],
        "stragglers/busy_min_s": min(busy),
        "stragglers/slowest_rank": float(slowest),
        "stragglers/slowest_data_wait_s": data_wait[slowest],
        "stragglers/data_wait_max_s": max(data_wait),
        "stragglers/data_wait_median_s": statistics.median(data_wait),
    }


def straggler_line(
    values: dict[str, float], hosts: list[str], steps: tuple[int, int], wall_s: float
) -> str:
    """The one line naming the slowest rank, and whether waiting for data is what sets it apart
    (its data wait is at least half of its extra busy time) or its own compute is."""
    rank = int(values["stragglers/slowest_rank"])
    busy, median = values["stragglers/busy_max_s"], values["stragglers/busy_median_s"]
    wait = values["stragglers/slowest_data_wait_s"]
    wait_median = values["stragglers/data_wait_median_s"]
    if 0 < wait - wait_median >= 0.5 * (busy - median):
        cause = "a slow data reader (waiting for data is most of the difference)"
    else:
        cause = "so not the data: slow compute, or a CPU shared with other work"
    return (
        f"Straggler: rank {rank} ({hosts[rank]}) was busy {busy:.2f}s in steps "
        f"{steps[0]}-{steps[1]} ({wall_s:.2f}s wall), "
        f"{values['stragglers/busy_max_over_median']:.2f}x the median rank's {median:.2f}s; "
        f"data wait {wait:.2f}s (median {wait_median:.2f}s): {cause}"
    )


class StragglerReport:
    """A step hook: ``before_step(step)`` and ``after_step(step)`` around each training step, on
    the training thread; ``report(step)`` at each log step, on every rank (a collective), ends the
    step's measurement first. ``data_wait()`` gives the step's wait for its batches."""

    def __init__(
        self,
        threshold: float,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        data_wait: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.threshold, self.rank, self.device = threshold, rank, device
        self.world_size = world_size
        self.enabled = threshold > 0 and world_size > 1
        self.hosts: list[str] | None = None  # gathered at the first report
        self._seen_first = False  # the run's first step is not counted
        self._start: tuple[float, float] = (0.0, 0.0)
        self._first_step: int | None = None  # of the interval, None until a step counted
        self._totals = [0.0, 0.0, 0.0]  # busy, data wait, wall
        self.data_wait = data_wait
        self._begun: int | None = None  # the step being measured
        self._ended: int | None = None  # the last step measured

    def before_step(self, step: int) -> None:
        if self.enabled:
            self._start = (busy_seconds(), time.perf_counter())
            self._begun = step

    def after_step(self, step: int) -> None:
        """Ends the step's measurement, unless its report did."""
        if self.enabled and self._ended != step:
            self.end(step, self.data_wait())

    def end(self, step: int, data_wait_s: float) -> None:
        if not self.enabled:
            return
        self._ended = step
        if not self._seen_first:
            self._seen_first = True
            return
        busy, wall = busy_seconds() - self._start[0], time.perf_counter() - self._start[1]
        self._totals = [a + b for a, b in zip(self._totals, (busy, data_wait_s, wall))]
        if self._first_step is None:
            self._first_step = step

    def report(self, step: int) -> dict[str, float]:
        """Every rank's numbers since the last report (one all_gather); rank 0 logs the line
        if the slowest is over the threshold. The spread, or {} (off, one rank, no step)."""
        if self.enabled and self._begun == step and self._ended != step:
            self.end(step, self.data_wait())
        if not self.enabled or self._first_step is None:
            return {}
        rows = self._gather(torch.tensor(self._totals, dtype=torch.float64)).tolist()
        first, self._first_step, self._totals = self._first_step, None, [0.0, 0.0, 0.0]
        if self.hosts is None:
            self.hosts = self._gather_hosts()
        values = summarize([r[0] for r in rows], [r[1] for r in rows])
        if self.rank == 0 and values["stragglers/busy_max_over_median"] > self.threshold:
            wall = max(r[2] for r in rows)
            logger.warning(straggler_line(values, self.hosts, (first, step), wall))
        return values

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        """``(world_size, 3)``: every rank's numbers, on the default group's device."""
        parts = [torch.empty_like(local, device=self.device) for _ in range(self.world_size)]
        dist.all_gather(parts, local.to(self.device))
        return torch.stack(parts).cpu()

    def _gather_hosts(self) -> list[str]:
        hosts: list[str] = [""] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        return hosts
