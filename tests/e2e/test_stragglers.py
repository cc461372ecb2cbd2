"""A straggler made for real: two gloo training processes, each pinned to a CPU of its own, then
busy-loop processes pinned beside rank 1. Rank 0's report names rank 1 (its training thread waits
for CPU 1 most of the time: runnable, so counted as busy, while rank 0 sleeps in the collectives
waiting for it), and TensorBoard gets the spread. Bounded in time; every process started is
killed by pid."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher import kill_all, tensorboard_scalars, train_env, worker_pids
from repo_paths import ROOT

ARGS = [
    "--training.steps",
    "2000",  # ended by the test once the report is seen
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "5",
    "--checkpoint.enable",
    "false",
]
LINE_RE = re.compile(r"Straggler: rank (\d+) \((.+?)\) was busy .* in steps (\d+)-(\d+) ")
HOGS = 6
# a busy loop on CPU 1 that also ends by itself, should this test be killed before its cleanup
HOG = (
    "import os, time\n"
    "os.sched_setaffinity(0, {1})\n"
    "end = time.time() + 300\n"
    "while time.time() < end:\n"
    "    pass\n"
)


def _log_lines(out: Path) -> list[str]:
    log = out / "logs" / "rank_0.log"
    return log.read_text().splitlines() if log.exists() else []


def _last_step(lines: list[str]) -> int:
    steps = [int(m.group(1)) for line in lines if (m := re.search(r"step: (\d+)  loss:", line))]
    return max(steps, default=0)


def _pin(pid: int, cpu: int) -> None:
    """Every thread of process ``pid`` onto ``cpu`` (threads made later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that just ended


def _wait_for_step(launcher: subprocess.Popen, out: Path, step: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while _last_step(_log_lines(out)) < step and time.time() < deadline:
        assert launcher.poll() is None, _log_lines(out)[-20:]
        time.sleep(0.2)


def _reports(out: Path, after: int) -> list[re.Match]:
    """The straggler lines of rank 0 whose interval began after step ``after``."""
    found = [m for line in _log_lines(out) if (m := LINE_RE.search(line))]
    return [m for m in found if int(m[3]) > after]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to pin ranks on")
def test_a_rank_beside_a_cpu_hog_is_named(tmp_path):
    out = tmp_path / "out"
    cmd = [str(ROOT / "run_llama_train.sh"), "--job.dump_folder", str(out), *ARGS]
    env = train_env(tmp_path, NGPU="2", OMP_NUM_THREADS="1")
    launcher = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    workers: list[int] = []
    hogs: list[subprocess.Popen] = []
    try:
        _wait_for_step(launcher, out, 5, timeout_s=240)
        ranks = worker_pids(str(out))
        workers = list(ranks.values())
        assert sorted(ranks) == [0, 1], ranks
        _pin(ranks[0], 0)
        _pin(ranks[1], 1)
        # each hog in a session of its own: with the scheduler's autogroups a session shares a
        # CPU fairly with the others, so HOGS of them leave rank 1 about 1/(HOGS + 1) of CPU 1
        hogs = [
            subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True)
            for _ in range(HOGS)
        ]
        hog_from = _last_step(_log_lines(out)) + 1  # later steps run beside the hogs
        deadline = time.time() + 90
        while not any(m[1] == "1" for m in _reports(out, hog_from)) and time.time() < deadline:
            assert launcher.poll() is None, _log_lines(out)[-20:]
            time.sleep(0.5)
    finally:
        kill_all([launcher, *hogs], workers)
    reports = _reports(out, hog_from)
    named = next((m for m in reports if m[1] == "1"), None)
    assert named is not None, [m[0] for m in reports]
    print(named.string)
    assert "so not the data" in named.string  # the hogs slow compute, not data reading
    step = int(named[4])
    assert tensorboard_scalars(out, "stragglers/slowest_rank")[step] == 1.0
    assert tensorboard_scalars(out, "stragglers/busy_max_over_median")[step] > 1.2
    busy_max = tensorboard_scalars(out, "stragglers/busy_max_s")[step]
    assert busy_max > 1.2 * tensorboard_scalars(out, "stragglers/busy_min_s")[step]
