"""Disk trouble during a checkpoint save, for real (gloo on CPU): the checkpoint folder is a small
tmpfs in a private mount namespace (``unshare -m``: nothing to unmount afterwards) that holds one
checkpoint of the debug model (about 70 MB) but not two, so the save at step 20 runs out of space;
or one that goes read-only after the first save. The previous checkpoint must stay complete and
load, the failed folder go, and the run either stop with one line (exit code 5) or train on
(``checkpoint.on_save_error = "continue"``). Two ranks agreeing on a failure only rank 0 sees (its
marker) run tests/helpers/save_failure_worker.py.

Every process a test starts is in its own session, killed by its process group on a timeout.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from launcher import kill_all, launch, train_env
from repo_paths import ROOT

from torchtitan.checkpoint import read_model_weights, scan

HELPERS = ROOT / "tests" / "helpers"
ARGS = [
    "--training.steps",
    "30",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "10",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "10",
]
SIZE = "100m"  # one checkpoint of the debug model (70 MB) fits, a second does not

# Inside the namespace: the tmpfs over the checkpoint folder, the training run, then a copy of
# what the folder holds (it goes with the namespace) and the run's exit code. With $WATCH set,
# the filesystem turns read-only once step-10 is marked complete.
SCRIPT = r"""
folder=$1 copy=$2 size=$3; shift 3
mkdir -p "$folder" && mount -t tmpfs -o size="$size" tmpfs "$folder" || exit 97
if [ -n "${WATCH:-}" ]; then
  ( until [ -f "$folder/step-10/COMPLETE" ]; do sleep 0.05; done
    until mount -o remount,ro "$folder"; do sleep 0.05; done ) &
fi
"$@"
rc=$?
cp -a "$folder" "$copy"
exit $rc
"""


def _can_unshare() -> bool:
    try:
        cmd = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"]
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _can_unshare(), reason="needs root and mount namespaces (unshare -m)"),
]


def _run(cmd: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    """``cmd`` in a session of its own; on a timeout the whole session is killed."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_all([proc])  # the launcher, its torchrun and the workers, each in its own session
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{cmd[0]} ran past {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        kill_all([proc])  # anything left behind
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _train_on_small_disk(tmp_path: Path, *args: str, ngpu: int = 2, watch: bool = False):
    """The launcher with the checkpoint folder on a tmpfs of SIZE; returns the run and the copy
    of the checkpoint folder as it was when the run ended."""
    out, copy = tmp_path / "out", tmp_path / "after"
    launcher = [str(ROOT / "run_llama_train.sh"), "--job.dump_folder", str(out), *ARGS, *args]
    cmd = [
        "unshare",
        "-m",
        "sh",
        "-c",
        SCRIPT,
        "sh",
        str(out / "checkpoint"),
        str(copy),
        SIZE,
        *launcher,
    ]
    env = train_env(tmp_path, NGPU=str(ngpu), **({"WATCH": "1"} if watch else {}))
    run = _run(cmd, env, timeout=600)
    assert run.returncode != 97, run.stderr  # the tmpfs could not be mounted
    return run, copy


def _errors(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("error:")]


def test_a_full_disk_stops_the_run_with_one_line_and_the_previous_checkpoint_loads(tmp_path):
    run, copy = _train_on_small_disk(tmp_path)
    output = run.stdout + run.stderr
    assert run.returncode == 5, output[-4000:]
    errors = _errors(run)
    assert len(errors) == 1, output[-4000:]
    folder = tmp_path / "out" / "checkpoint"
    assert errors[0].startswith("error: rank ")  # whichever rank wrote first; both agree
    assert errors[0].split(": ", 2)[2] == (
        f"checkpoint save to {folder / 'step-20'} failed: [Errno 28] No space left on device "
        f"(ranks 0, 1); the newest complete checkpoint, {folder / 'step-10'}, is kept; free space "
        "(or fix what the error names) and start again to resume, or set "
        'checkpoint.on_save_error = "continue" to train on when a save fails'
    ), errors[0]
    assert "Traceback" not in output, output[-4000:]
    assert "step: 20" in run.stdout and "step: 21" not in run.stdout  # stopped at the save
    # step-10 as it was, step-20 removed (it filled the disk)
    assert [(c.step, c.complete) for c in scan(str(copy))] == [(10, True)]
    # and the next start resumes from it (the folder copied where a run of 10 steps finds it)
    resume = tmp_path / "resume"
    shutil.copytree(copy, resume / "out" / "checkpoint")
    again = launch(resume, *ARGS[2:], "--training.steps", "10", ngpu=2, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "Loaded training state from" in again.stdout and "(step 10)" in again.stdout
    assert "Already trained to step 10 of 10: nothing to do" in again.stdout


def test_with_continue_a_full_disk_is_logged_and_training_goes_on(tmp_path):
    """Background saves: each rank finds the failure when its save thread ends."""
    run, copy = _train_on_small_disk(
        tmp_path, "--checkpoint.async_mode", "async", "--checkpoint.on_save_error", "continue"
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "step: 30" in run.stdout and "Training finished" in run.stdout
    assert not _errors(run) and "Traceback" not in output, output[-4000:]
    folder = tmp_path / "out" / "checkpoint"
    failed = [line.split(" ERROR ", 1)[1] for line in run.stdout.splitlines() if " ERROR " in line]
    assert failed == [
        f"checkpoint save to {folder / f'step-{step}'} failed: [Errno 28] No space left on "
        f'device (ranks 0, 1); {goes_on} (checkpoint.on_save_error = "continue"); the newest '
        f"complete checkpoint, {folder / 'step-10'}, is kept"
        for step, goes_on in [
            (20, "training goes on and the next save tries again"),
            (30, "the run ends without it"),
        ]
    ], output[-4000:]
    assert [(c.step, c.complete) for c in scan(str(copy))] == [(10, True)]
    assert len(read_model_weights(str(copy / "step-10"))) > 0


def test_a_filesystem_gone_read_only_stops_the_run_at_its_next_save(tmp_path):
    """One process, background saves: the step-20 save fails as it starts (read-only), the
    failure is found, and acted on at the next save (the last step's)."""
    run, copy = _train_on_small_disk(
        tmp_path, "--checkpoint.async_mode", "async", ngpu=1, watch=True
    )
    output = run.stdout + run.stderr
    assert run.returncode == 5, output[-4000:]
    errors = _errors(run)
    folder = tmp_path / "out" / "checkpoint"
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    assert errors[0].startswith(
        f"error: checkpoint save to {folder / 'step-20'} failed: [Errno 30] Read-only file system"
    ), errors[0]
    assert f"the newest complete checkpoint, {folder / 'step-10'}, is kept" in errors[0]
    assert "the run stops at its next save or its end" in run.stdout  # logged when found
    assert "step: 30" in run.stdout  # trained on to the next save, which stopped it
    assert [(c.step, c.complete) for c in scan(str(copy))] == [(10, True)]


@pytest.mark.parametrize(
    "mode",
    ["sync stop", "sync continue", "async stop", "async continue"],
)
def test_two_ranks_agree_on_a_failure_only_rank_0_sees(pools, tmp_path, mode):
    """Rank 0's COMPLETE marker cannot be written. Synchronously, both ranks decide at that
    save; in the background, rank 0 finds out at once and rank 1 not at all, and both decide
    at the next save. (In the session's warm pool of 2 ranks.)"""
    sync, on_error = mode.split()
    ranks = pools(2).run("save_failure_worker:run", str(tmp_path), sync, on_error, meshes=True)
    output = "\n".join(line for lines in ranks for line in lines)
    results = sorted(
        line.split(" ", 3)[1:] for line in output.splitlines() if line.startswith("RESULT ")
    )
    logged = sorted(
        line.split(" ", 2)[1] for line in output.splitlines() if line.startswith("LOG ")
    )
    folder = tmp_path / "checkpoint"
    failed = f"checkpoint save to {folder / 'step-10'} failed: [Errno 28] No space left on device"
    decided_at = "save-10" if sync == "sync" else "save-15"
    for rank in "01":  # the same outcome on both ranks, at the same call
        outcome = dict((call, what) for r, call, what in results if r == rank)
        if on_error == "stop":
            assert outcome[decided_at].startswith(
                f"raised {failed}; the newest complete checkpoint, {folder / 'step-5'}, is kept"
            )
        else:
            assert outcome.get("save-10", "returned None") == "returned None", outcome
            assert outcome["save-15"] == f"returned {folder / 'step-15'}", outcome
    if on_error == "continue":  # each rank logged it once (rank 0 when it found it)
        assert logged == ["0", "1"], output
        assert [(c.step, c.complete) for c in scan(str(folder))] == [(15, True)]
    elif sync == "async":  # rank 0 logged it when it found it; stopped before step 15
        assert logged == ["0"], output
        assert [(c.step, c.complete) for c in scan(str(folder))] == [(5, True)]
