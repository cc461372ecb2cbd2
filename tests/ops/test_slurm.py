"""The unedited multinode_trainer.slurm on a real two-node Slurm cluster on this one host.

Debian's slurm-wlm (built with multiple-slurmd support) runs two ``slurmd -N nodeX`` daemons with
their own ports and NodeAddr=127.0.0.1, next to a slurmctld and a munged whose key, socket,
state and logs all live in a temp folder. The node names resolve nowhere, so the job only runs
if the script hands torchrun the NodeAddr Slurm knows. Needs root; installs slurm-wlm and munge
with apt-get when they are missing; skips with the reason when that cannot be done."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from launcher import (
    FOUR_WORKER_ARGS,
    PREEMPT_ARGS,
    STEP_RE,
    running,
    tensorboard_scalars,
    tensorboard_scalars_all_runs,
    train_env,
)
from ports import free_ports
from repo_paths import ROOT

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "munge")


def _missing() -> list[str]:
    return [b for b in (*DAEMONS, *CLIENTS) if shutil.which(b) is None]


def _install() -> str | None:
    """apt-get install slurm-wlm munge; why it failed, or None."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    for attempt in range(2):
        if attempt:  # the package lists may be missing or stale
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if done.returncode == 0 and not _missing():
            return None
    return f"apt-get install slurm-wlm munge failed: {(done.stderr or done.stdout).strip()[-300:]}"


def _config(folder: Path, munge_socket: Path) -> str:
    ctld, slurmd, node1, node2 = free_ports(4)
    cpus = os.cpu_count() or 2  # slurmd drains a node configured with more CPUs than it has
    host = socket.gethostname()
    return f"""\
ClusterName=torchtitan-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire=10
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd.%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=node1 NodeAddr=127.0.0.1 NodeHostname={host} Port={node1} CPUs={cpus} State=UNKNOWN
NodeName=node2 NodeAddr=127.0.0.1 NodeHostname={host} Port={node2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
"""


def _stop(pid_files: list[Path]) -> None:
    """SIGTERM every daemon this test started (by its pid file), then SIGKILL what is left."""
    pids = []
    for pid_file in pid_files:
        try:
            pids.append(int(pid_file.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + 10
        while time.time() < deadline and any(running(p) for p in pids):
            time.sleep(0.2)


@pytest.fixture(scope="module")
def slurm():
    """A running two-node cluster; yields the environment that talks to it (SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run slurmctld, slurmd and munged")
    if _missing() and (why := _install()):
        pytest.skip(why)
    # munged refuses a socket whose folders are not all world-executable (pytest's are 0700)
    folder = Path(tempfile.mkdtemp(prefix="torchtitan-slurm-"))
    folder.chmod(0o755)
    (folder / "state").mkdir()
    munge_socket = folder / "munge.sock"
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = folder / "slurm.conf"
    conf.write_text(_config(folder, munge_socket))
    env = dict(os.environ, SLURM_CONF=str(conf))
    pid_files = [folder / "munged.pid", folder / "slurmctld.pid"] + [
        folder / f"slurmd.node{i}.pid" for i in (1, 2)
    ]
    try:
        subprocess.run(
            [
                "munged",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={folder}/munged.pid",
                f"--log-file={folder}/munged.log",
                f"--seed-file={folder}/munged.seed",
            ],
            check=True,
            env=env,
        )
        subprocess.run(["slurmctld", "-f", str(conf), "-i"], check=True, env=env)
        for node in ("node1", "node2"):
            (folder / "spool" / node).mkdir(parents=True)
            subprocess.run(["slurmd", "-f", str(conf), "-N", node], check=True, env=env)
        deadline = time.time() + 60
        states = ""
        while time.time() < deadline:
            states = subprocess.run(
                ["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True
            ).stdout
            if states.split().count("idle") == 2:
                break
            time.sleep(0.5)
        else:
            log = (folder / "slurmctld.log").read_text()[-2000:]
            pytest.fail(f"the nodes did not come up: {states!r}\n{log}")
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user", "root"], env=env, capture_output=True)
        _stop(pid_files)
        shutil.rmtree(folder, ignore_errors=True)


def _submit(env: dict[str, str], tmp_path: Path, *args: str) -> tuple[str, str]:
    """sbatch --nodes=2 multinode_trainer.slurm ARGS from the checkout; waits for the job to
    end (polling scontrol: sbatch --wait polls slowly) and returns its state and output."""
    job = _sbatch(env, tmp_path, *args)
    return _wait(env, job), _output(tmp_path, job)


def _sbatch(env: dict[str, str], tmp_path: Path, *args: str) -> str:
    """The job id of ``sbatch --nodes=2 multinode_trainer.slurm ARGS``, NGPU=2 per node."""
    job_env = train_env(tmp_path, **{"SLURM_CONF": env["SLURM_CONF"], "NGPU": "2"})
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--nodes=2",
            f"--output={tmp_path}/%x-%j.out",
            "multinode_trainer.slurm",
            f"--job.dump_folder={tmp_path}/out",
            *args,
        ],
        cwd=ROOT,
        env=job_env,
        capture_output=True,
        text=True,
        check=True,
    )
    return submitted.stdout.strip().split(";")[0]


def _output(tmp_path: Path, job: str) -> str:
    path = tmp_path / f"torchtitan-{job}.out"
    return path.read_text() if path.exists() else ""


def _job_field(env: dict[str, str], job: str, field: str) -> str:
    info = subprocess.run(
        ["scontrol", "show", "job", job], env=env, capture_output=True, text=True
    ).stdout
    return next((w.split("=", 1)[1] for w in info.split() if w.startswith(f"{field}=")), "")


def _diagnosis(env: dict[str, str], job: str) -> str:
    """What Slurm says of the job and the tail of its controller's log, for a failure message."""
    info = subprocess.run(
        ["scontrol", "show", "job", job], env=env, capture_output=True, text=True
    ).stdout
    log = Path(env["SLURM_CONF"]).parent / "slurmctld.log"
    return f"{info}\n--- slurmctld.log ---\n{log.read_text()[-3000:] if log.exists() else ''}"


def _wait(env: dict[str, str], job: str, timeout: float = 600) -> str:
    """The job's final state, polled until it has one (a requeued job runs again first)."""
    deadline = time.time() + timeout
    state = ""
    while time.time() < deadline:
        state = _job_field(env, job, "JobState")
        if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", ""):
            return state
        time.sleep(1)
    subprocess.run(["scancel", job], env=env)
    pytest.fail(f"job {job} still {state} after {timeout} s")


@pytest.mark.slow
def test_sbatch_trains_on_two_nodes_with_world_size_four(slurm, tmp_path, one_host_losses):
    state, output = _submit(slurm, tmp_path, *FOUR_WORKER_ARGS)
    assert state == "COMPLETED", output[-4000:]
    assert "on node1 node2 (nnodes=2), rendezvous at 127.0.0.1:" in output, output[:2000]
    for rank in (0, 1):
        assert f"nnodes=2 node_rank={rank} nproc_per_node=2 world_size=4" in output
    assert "world_size=4 dp_replicate=1 dp_shard=4" in output
    losses = tensorboard_scalars(tmp_path / "out")
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        assert abs(loss - one_host_losses[step]) <= 1e-5, (step, loss, one_host_losses[step])


@pytest.mark.slow
def test_a_bad_override_fails_the_job_with_one_line_per_node(slurm, tmp_path):
    state, output = _submit(slurm, tmp_path, "--training.stepz=3")
    assert state == "FAILED"
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    # Each node's launcher finds the typo and prints the same line; a node may miss printing it
    # if srun ends its task first (60 s after the first node's, --wait).
    assert len(errors) in (1, 2) and len(set(errors)) == 1, output[-3000:]
    assert "training.stepz" in errors[0] and "training.steps" in errors[0], output[-3000:]
    assert "Traceback" not in output


@pytest.mark.slow
def test_the_time_limit_signal_saves_requeues_and_the_job_resumes_exactly(
    slurm, tmp_path, one_host_preempt_losses
):
    """``scancel --batch --signal=USR1`` is what ``#SBATCH --signal=B:USR1@300`` sends ahead of
    the time limit: the script passes it to srun, every worker saves the same step and exits
    with 160, the script requeues the job, and the job run again resumes from that step."""
    job = _sbatch(slurm, tmp_path, *PREEMPT_ARGS)
    deadline = time.time() + 300
    while max((int(s) for s, _ in STEP_RE.findall(_output(tmp_path, job))), default=0) < 5:
        assert time.time() < deadline, _output(tmp_path, job)[-3000:]
        assert _job_field(slurm, job, "JobState") in ("PENDING", "RUNNING", "CONFIGURING")
        time.sleep(0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm, check=True)
    # Slurm starts a requeued job again cred_expire (slurm.conf, 10 s here, 120 by default) + 1 s
    # later: a start sooner is refused by the nodes ("Job credential revoked"), which still hold
    # the revoked credential of the first run.
    state = _wait(slurm, job)
    output = _output(tmp_path, job)
    assert state == "COMPLETED", output[-3000:] + _diagnosis(slurm, job)
    assert _job_field(slurm, job, "Restarts") == "1", output[-4000:]
    # one line from each node's launcher, wherever the two nodes' output interleaves; a failure
    # shows both runs' lines but the steps' (the head and tail alone hid why, twice, under load)
    story = "\n".join(line for line in output.splitlines() if not STEP_RE.search(line))
    saved = re.findall(r"preempted by SIGUSR1 after step (\d+)", output)
    assert len(saved) == 2, story[-8000:]
    # each node's task ended by itself with 160: under --kill-on-bad-exit the first node's 160
    # once made srun kill the rendezvous host while it was still leaving (143, no requeue)
    ended = re.findall(r"srun: error: (node\d+): task \d+: Exited with exit code 160", output)
    assert sorted(ended) == ["node1", "node2"], story[-8000:]
    step = int(saved[0])
    assert f"slurm: job {job} preempted and saved (restart 0): requeued to resume" in output
    assert f"Loaded training state from {tmp_path}/out/checkpoint/step-{step}" in output
    losses = tensorboard_scalars_all_runs(tmp_path / "out")
    assert sorted(losses) == list(range(1, 17))
    for s, loss in losses.items():
        assert abs(loss - one_host_preempt_losses[s]) <= 1e-6, (s, loss)
