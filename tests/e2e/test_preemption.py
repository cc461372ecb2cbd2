"""Preemption for real: a stop signal to the launcher (as Kubernetes and Slurm send it) or to one
worker makes every rank save the same step and exit with code 160, and the job started again
continues exactly where an unbroken run would be. Each run is bounded in time and every process
it started is cleaned up by pid."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from launcher import (
    kill_all,
    last_logged_step,
    launch,
    pooled,
    start,
    tensorboard_scalars,
    tensorboard_scalars_all_runs,
    worker_pids,
)

from torchtitan.checkpoint.folder import read_marker

STEPS = 16
ARGS = [
    "--training.steps",
    str(STEPS),
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "42",
    "--debug.deterministic",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "1000",  # only the preemption's save and the last step's
]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _signal_mid_run(
    tmp_path: Path,
    sig: signal.Signals,
    to_rank: int | None,
    after: int = 5,
    times: int = 1,
    whole_job: bool = False,
) -> tuple[int, str, list[int]]:
    """Start the 2-process run, send ``sig`` after step ``after`` to the launcher's process
    group (as a terminal's Ctrl-C and a kill of the launcher reach it; ``to_rank`` None) or to
    that rank's worker alone, ``times`` times 0.2 s apart; (exit code, output, worker pids).
    ``whole_job``: first to torchrun and every worker, as a cluster that signals every process
    of the job does; 0.05 s later to the launcher, which passes it to torchrun; 0.05 s later to
    torchrun again (a second signal from the cluster)."""
    out = tmp_path / "out"
    proc = start(tmp_path, *ARGS, ngpu=2)
    pids: list[int] = []
    try:
        deadline = time.time() + 300
        while last_logged_step(out / "logs" / "rank_0.log") < after and time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        ranks = worker_pids(str(out))
        pids = list(ranks.values())
        assert sorted(ranks) == [0, 1], ranks
        torchrun = _parent(ranks[0])
        if whole_job:
            for pid in (torchrun, *pids):
                os.kill(pid, sig)
            time.sleep(0.05)
        for i in range(times):
            time.sleep(0.2 * (i > 0))
            if to_rank is None:
                os.killpg(proc.pid, sig)  # start() gave the launcher a session of its own
            else:
                os.kill(ranks[to_rank], sig)
        if whole_job:
            time.sleep(0.05)
            os.kill(torchrun, sig)
        output, _ = proc.communicate(timeout=120 if whole_job else 300)
    finally:
        kill_all([proc], pids)
    return proc.returncode, output, pids


def _saved_step(output: str, sig: signal.Signals, out: Path) -> int:
    """The step of the one ``preempted`` (or ``stopped by Ctrl-C``) line, checked against the
    checkpoint folder."""
    ctrl_c = sig == signal.SIGINT
    start, resume = (
        ("stopped by Ctrl-C", "run the same command to resume")
        if ctrl_c
        else (f"preempted by {sig.name}", "start the job again to resume")
    )
    lines = [ln for ln in output.splitlines() if start in ln]
    assert len(lines) == 1, output[-3000:]
    line = lines[0]
    assert line.startswith(f"{start} after step "), line
    step = int(line.split("after step ")[1].split(":")[0])
    path = out / "checkpoint" / f"step-{step}"
    assert line.endswith(f"saved to {path}; {resume}"), line
    assert read_marker(str(path))["step"] == step and not read_marker(str(path))["model_only"]
    assert not [ln for ln in output.splitlines() if ln.startswith("error:")], output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return step


@pytest.fixture(scope="module")
def unbroken(pools, tmp_path_factory) -> dict[int, float]:
    """The losses of the 2-process run, start to end: in the warm pool of 2 ranks, whose losses
    are the launcher's bit for bit (tests/e2e/test_pool.py)."""
    tmp = tmp_path_factory.mktemp("unbroken")
    pooled(pools, tmp, *ARGS, ngpu=2)
    return tensorboard_scalars(tmp / "out")


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, code, after",
    [(signal.SIGTERM, 160, 5), (signal.SIGINT, 130, 4)],  # a cluster's stop; a terminal's Ctrl-C
    ids=["sigterm", "ctrl_c"],
)
def test_a_stop_signal_saves_and_the_resumed_job_matches_an_unbroken_one(
    tmp_path, unbroken, sig, code, after
):
    expected = unbroken
    rc, output, _ = _signal_mid_run(tmp_path, sig, to_rank=None, after=after)
    assert rc == code, output[-3000:]
    step = _saved_step(output, sig, tmp_path / "out")
    assert after <= step < STEPS, step

    again = launch(tmp_path, *ARGS, ngpu=2)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"Loaded training state from {tmp_path / 'out' / 'checkpoint' / f'step-{step}'}" in (
        again.stdout + again.stderr
    ), again.stderr[-3000:]
    losses = tensorboard_scalars_all_runs(tmp_path / "out")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for s, loss in losses.items():
        assert abs(loss - expected[s]) <= 1e-6, (s, loss, expected[s])


@pytest.mark.slow
def test_a_second_ctrl_c_stops_every_process_at_once_without_a_traceback(tmp_path):
    t0 = time.time()
    rc, output, pids = _signal_mid_run(tmp_path, signal.SIGINT, to_rank=None, after=2, times=2)
    assert rc == 130, output[-3000:]
    assert time.time() - t0 < 120, "a second Ctrl-C should not wait for the next step or a save"
    line = "stopped by a second Ctrl-C: nothing more saved (the newest complete checkpoint, if any, stays)"
    lines = [ln for ln in output.splitlines() if "Ctrl-C" in ln and "INFO" not in ln]
    assert lines == [line], output[-3000:]
    assert "Traceback" not in output and "Killed" not in output, output[-3000:]
    deadline = time.time() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.time() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "workers left running"


@pytest.mark.slow
def test_a_signal_to_one_worker_stops_every_rank_after_the_same_step(tmp_path):
    rc, output, _ = _signal_mid_run(tmp_path, signal.SIGUSR1, to_rank=1)
    assert rc == 160, output[-3000:]
    step = _saved_step(output, signal.SIGUSR1, tmp_path / "out")
    for rank in (0, 1):  # rank 0 got no signal: it learned of rank 1's at a step boundary
        log = (tmp_path / "out" / "logs" / f"rank_{rank}.log").read_text()
        assert f"SIGUSR1 received: saving step {step} before stopping" in log, log[-2000:]


@pytest.mark.slow
def test_a_signal_to_every_process_of_the_job_saves_once_and_ends(tmp_path):
    """As Slurm sends ``scancel --signal`` and its time-limit signal: torchrun and the workers
    get it from the cluster, and torchrun again from the launcher and the cluster. torchrun
    alone raised on each one while it waited for its workers, and after the third it hung at
    exit (torchtitan/resilience/torchrun.py)."""
    rc, output, pids = _signal_mid_run(tmp_path, signal.SIGUSR1, to_rank=None, whole_job=True)
    assert rc == 160, output[-3000:]
    step = _saved_step(output, signal.SIGUSR1, tmp_path / "out")  # one line, no traceback
    log = (tmp_path / "out" / "logs" / "rank_0.log").read_text()
    assert f"SIGUSR1 received: saving step {step} before stopping" in output, log[-2000:]
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "workers left running"
