"""Faults made for real in real training processes (gloo on CPU), each bounded in time, every
process started cleaned up by pid.

A rank stopped with SIGSTOP mid-run: the other rank stalls in the step's collectives; its hang
watchdog writes its stacks under ``hangs/step-N/`` and says so, and the collective timeout
(``comm.train_timeout_seconds``) then ends it with one line naming the collective it waited in
and the folder of the stacks (exit code 4), no traceback. The watchdog keeps its default floor
(60 s), longer than the timeout: it must fire first all the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launcher import kill_all, last_logged_step, running, train_env, worker_pids
from repo_paths import ROOT

ARGS = [
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--checkpoint.enable",
    "false",
]


@pytest.mark.slow
def test_a_stopped_rank_leaves_stacks_and_a_timeout(tmp_path):
    timeout_s = 12
    out = tmp_path / "out"
    cmd = [
        str(ROOT / "run_llama_train.sh"),
        "--job.dump_folder",
        str(out),
        *ARGS,
        "--training.steps",
        "500",
        "--comm.train_timeout_seconds",
        str(timeout_s),
    ]
    env = train_env(tmp_path, NGPU="2")
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        deadline = time.time() + 300
        while last_logged_step(out / "logs" / "rank_0.log") < 5 and time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.1)
        ranks = worker_pids(str(out))
        pids = list(ranks.values())  # cleaned up even if the next line fails
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at, stopped_after = time.time(), last_logged_step(out / "logs" / "rank_0.log")
        # rank 0 ends itself; torchrun then gives the stopped rank 30 s (its fixed close timeout)
        # to take a SIGTERM it cannot take before it kills it: the test kills it at once
        while running(ranks[0]) and time.time() < stopped_at + timeout_s + 90:
            time.sleep(0.2)
        took = time.time() - stopped_at
        os.kill(ranks[1], signal.SIGKILL)
        output, _ = proc.communicate(timeout=120)
    finally:
        kill_all([proc], pids)
    assert proc.returncode == 4, output[-3000:]  # CollectiveTimeout's code
    assert took < timeout_s + 90, took  # the timeout ended it, not the test
    # one line for the waiting rank, naming the collective and where the library called it
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith(
        f"error: rank 0: a collective timed out after {timeout_s}s waiting in "
    ), errors
    assert "(from torchtitan/" in errors[0] or "(from train.py" in errors[0], errors
    folder = errors[0].split("every waiting rank's stacks are in ")[-1].rstrip("/")
    assert (Path(folder) / "rank_0.txt").is_file(), errors
    assert "Traceback" not in output, output[-3000:]  # torchrun's report is replaced by the line
    # (a step before the stop may have been slow on a loaded machine: only those after count)
    hung = [
        p
        for p in (out / "hangs").glob("step-*/rank_0.txt")
        if int(p.parent.name.split("-")[1]) >= stopped_after
    ]
    assert len(hung) == 1, (hung, output[-3000:])
    step = int(hung[0].parent.name.split("-")[1])
    assert step <= stopped_after + 2, (step, stopped_after)
    text = hung[0].read_text()
    assert text.startswith(f"rank 0, step {step}: running for"), text[:300]
    assert "train.py" in text  # the main thread's stack, down from the training loop
