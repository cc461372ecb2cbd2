"""The straggler report in one process: the spread over ranks (median, ratio, slowest rank), the
one line and its data-versus-compute wording, no collective when off or alone, and the busy-time
reader (a spinning thread's grows, a sleeping thread's does not)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from log_capture import logged

from torchtitan.resilience.stragglers import (
    StragglerReport,
    busy_seconds,
    straggler_line,
    summarize,
)


@pytest.fixture
def lines_logged():
    with logged() as lines:
        yield lines


@pytest.fixture
def no_collectives(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("no collective expected")

    monkeypatch.setattr(dist, "all_gather", refuse)
    monkeypatch.setattr(dist, "all_gather_object", refuse)


def test_summarize_median_ratio_and_slowest_rank():
    v = summarize(busy=[1.0, 1.2, 3.3, 1.0], data_wait=[0.1, 0.2, 0.4, 0.3])
    assert v["stragglers/busy_median_s"] == pytest.approx(1.1)  # mean of the middle two
    assert v["stragglers/busy_max_over_median"] == pytest.approx(3.0)
    assert v["stragglers/slowest_rank"] == 2.0
    assert v["stragglers/busy_max_s"] == 3.3
    assert v["stragglers/busy_min_s"] == 1.0
    assert v["stragglers/slowest_data_wait_s"] == 0.4
    assert v["stragglers/data_wait_max_s"] == 0.4
    assert v["stragglers/data_wait_median_s"] == pytest.approx(0.25)
    assert all(isinstance(x, float) for x in v.values())  # TensorBoard scalars


def test_the_line_says_compute_when_data_wait_is_like_the_others():
    v = summarize(busy=[2.0, 2.0, 4.0], data_wait=[0.1, 0.1, 0.1])
    line = straggler_line(v, ["a", "b", "node7"], (11, 20), wall_s=5.0)
    assert line == (
        "Straggler: rank 2 (node7) was busy 4.00s in steps 11-20 (5.00s wall), 2.00x the "
        "median rank's 2.00s; data wait 0.10s (median 0.10s): so not the data: slow compute, "
        "or a CPU shared with other work"
    )


def test_the_line_says_data_when_data_wait_is_what_differs():
    v = summarize(busy=[2.0, 3.0, 2.0], data_wait=[0.1, 0.9, 0.1])
    line = straggler_line(v, ["a", "b", "c"], (1, 5), wall_s=4.0)
    assert line.startswith("Straggler: rank 1 (b) was busy 3.00s in steps 1-5")
    assert line.endswith(
        "data wait 0.90s (median 0.10s): a slow data reader (waiting for data is most of the "
        "difference)"
    )


@pytest.mark.parametrize(("threshold", "world_size"), [(0.0, 4), (1.2, 1)])
def test_off_or_alone_means_no_collective(threshold, world_size, no_collectives):
    report = StragglerReport(threshold, rank=0, world_size=world_size, device=torch.device("cpu"))
    for step in range(1, 6):
        report.before_step(step)
        report.end(step, data_wait_s=0.01)
    assert report.report(5) == {}


def _fake_world(report: StragglerReport, rows: list[list[float]], gathered: list) -> None:
    """Every rank's (busy, data wait, wall) is ``rows``; what this rank sent goes to ``gathered``."""

    def gather(local: torch.Tensor) -> torch.Tensor:
        gathered.append(local.tolist())
        return torch.tensor(rows, dtype=torch.float64)

    report._gather = gather
    report._gather_hosts = lambda: ["host0", "host1", "host2"]


def _steps(report: StragglerReport, steps: range, data_wait_s: float) -> None:
    for step in steps:
        report.before_step(step)
        time.sleep(0.001)
        report.end(step, data_wait_s=data_wait_s)


SLOW_RANK_1 = [[1.0, 0.02, 5.5], [5.0, 0.02, 5.5], [1.0, 0.02, 5.5]]


def test_one_gather_per_log_step_and_one_line_on_rank_0(lines_logged):
    report = StragglerReport(1.2, rank=0, world_size=3, device=torch.device("cpu"))
    gathered: list = []
    _fake_world(report, SLOW_RANK_1, gathered)
    _steps(report, range(1, 2), data_wait_s=0.5)
    assert report.report(1) == {}  # the first step of the run is not counted: nothing to gather
    _steps(report, range(2, 6), data_wait_s=0.01)
    values = report.report(5)
    assert len(gathered) == 1
    busy, wait, wall = gathered[0]  # what this rank sent: steps 2-5
    assert wait == pytest.approx(0.04)
    assert 0 <= busy <= wall and wall >= 0.004
    assert values == summarize([1.0, 5.0, 1.0], [0.02, 0.02, 0.02])
    assert lines_logged == [straggler_line(values, ["host0", "host1", "host2"], (2, 5), 5.5)]
    _steps(report, range(6, 11), data_wait_s=0.0)  # the next interval starts afresh
    report.report(10)
    assert gathered[1][1] == 0.0
    assert len(lines_logged) == 2 and " in steps 6-10 " in lines_logged[1]


def test_no_line_below_the_threshold_nor_on_other_ranks(lines_logged):
    even = StragglerReport(1.2, rank=0, world_size=3, device=torch.device("cpu"))
    _fake_world(even, [[1.0, 0.0, 2.0], [1.1, 0.0, 2.0], [1.0, 0.0, 2.0]], [])
    _steps(even, range(1, 4), data_wait_s=0.0)
    assert even.report(3)["stragglers/busy_max_over_median"] == pytest.approx(1.1)
    rank1 = StragglerReport(1.2, rank=1, world_size=3, device=torch.device("cpu"))
    _fake_world(rank1, SLOW_RANK_1, [])
    _steps(rank1, range(1, 4), data_wait_s=0.0)
    assert rank1.report(3)["stragglers/slowest_rank"] == 1.0  # every rank gets the spread
    assert lines_logged == []  # but only rank 0 logs


def _busy_of(work, seconds: float) -> float:
    """Busy seconds a new thread gains while doing ``work(seconds)``, read by the thread."""
    result: list[float] = []

    def run() -> None:
        before = busy_seconds()
        work(seconds)
        result.append(busy_seconds() - before)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return result[0]


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat"), reason="Linux schedstat")
def test_busy_time_grows_when_spinning_not_when_sleeping():
    assert _busy_of(_spin, 0.3) > 0.25  # on a CPU or waiting for one: counted either way
    assert _busy_of(time.sleep, 0.3) < 0.05


def test_without_schedstat_busy_time_is_thread_cpu_time():
    before = busy_seconds("/nonexistent/schedstat")
    _spin(0.1)
    time.sleep(0.1)
    grew = busy_seconds("/nonexistent/schedstat") - before
    assert 0.02 < grew < 0.15  # the spin (CPU time, less on a loaded machine), not the sleep
