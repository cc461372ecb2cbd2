"""run_llama_train.sh resolves where it runs from its environment (local, explicit multi-node,
Kubeflow with PET_* or WORLD_SIZE/RANK variables), and a job spread over two hosts trains with
world size 4. The hosts are two network namespaces joined by a veth pair, each with its own
address and its own hostname (a UTS namespace), one launcher in each (needs root, iproute2 and
util-linux's unshare; skipped with the reason otherwise)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from launcher import (
    FOUR_WORKER_ARGS,
    PREEMPT_ARGS,
    cpu_worker_threads,
    last_logged_step,
    tensorboard_scalars,
    tensorboard_scalars_all_runs,
    train_env,
    worker_pids,
)
from repo_paths import ROOT

SCRIPT = str(ROOT / "run_llama_train.sh")


def _dry_run(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not _is_launch_variable(k)}
    clean.update(env, DRY_RUN="1")
    return subprocess.run(
        [SCRIPT, "--training.steps", "3"], env=clean, capture_output=True, text=True, timeout=60
    )


def _is_launch_variable(name: str) -> bool:
    launch_vars = {
        "NNODES",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "RANK",
        "NGPU",
        "RDZV_ID",
        "SLURM_JOB_ID",
    }
    return name in launch_vars or name.startswith("PET_")


@pytest.mark.parametrize(
    "env, resolved, flags",
    [
        (
            {},
            "launch: local: nnodes=1 node_rank=0 nproc_per_node=1 world_size=1",
            ["--standalone", "--nnodes=1"],
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "NGPU": "8"},
            "launch: multi-node (NNODES): nnodes=2 node_rank=1 nproc_per_node=8 world_size=16 "
            "rendezvous=c10d at 10.0.0.1:29500",
            [
                "--nnodes=2",
                "--rdzv-backend=c10d",
                "--rdzv-endpoint=10.0.0.1:29500",
                "--rdzv-conf=is_host=0",
                "--nproc-per-node=8",
            ],
        ),
        # newer training operators: torchrun's own variables win over WORLD_SIZE (= processes)
        (
            {
                "PET_NNODES": "4",
                "PET_NODE_RANK": "0",
                "PET_MASTER_ADDR": "job-master-0",
                "PET_MASTER_PORT": "23456",
                "PET_NPROC_PER_NODE": "8",
                "WORLD_SIZE": "32",
                "RANK": "0",
                "MASTER_ADDR": "job-master-0",
                "MASTER_PORT": "23456",
            },
            "launch: Kubeflow (PET_* variables): nnodes=4 node_rank=0 nproc_per_node=8 world_size=32",
            ["--nnodes=4", "--rdzv-endpoint=job-master-0:23456", "--rdzv-conf=is_host=1"],
        ),
        # NGPU chooses the processes per pod over PET_NPROC_PER_NODE ("auto" is not a count)
        (
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "m",
                "PET_MASTER_PORT": "1234",
                "PET_NPROC_PER_NODE": "auto",
                "NGPU": "2",
            },
            "nnodes=2 node_rank=1 nproc_per_node=2 world_size=4 rendezvous=c10d at m:1234",
            [],
        ),
        # older operators: WORLD_SIZE counts pods, RANK is the pod's index
        (
            {
                "MASTER_ADDR": "job-master-0",
                "MASTER_PORT": "23456",
                "WORLD_SIZE": "3",
                "RANK": "2",
                "NGPU": "4",
            },
            "launch: Kubeflow (WORLD_SIZE pods, RANK pod index): nnodes=3 node_rank=2 "
            "nproc_per_node=4 world_size=12",
            ["--nnodes=3", "--rdzv-endpoint=job-master-0:23456", "--rdzv-conf=is_host=0"],
        ),
        (
            {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "SLURM_JOB_ID": "77"},
            "world_size=2",
            ["--rdzv-id=77"],
        ),
    ],
    ids=["local", "explicit", "kubeflow_pet", "kubeflow_pet_ngpu", "kubeflow_pods", "slurm_id"],
)
def test_the_launch_is_resolved_from_the_environment(env, resolved, flags):
    out = _dry_run(**env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert resolved in lines[0], lines
    command = lines[1].split()
    assert lines[1].startswith("+ ") and "torchtitan.resilience.torchrun" in command
    for flag in flags:
        assert flag in command, (flag, command)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="CPU workers' threads")
@pytest.mark.parametrize("ngpu", [1, 2, 64])
def test_cpu_workers_share_the_cores_and_a_thread_count_set_wins(ngpu, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    command = _dry_run(NGPU=str(ngpu)).stdout.splitlines()[1]
    assert command.startswith(f"+ OMP_NUM_THREADS={cpu_worker_threads(ngpu)} "), command
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _dry_run(NGPU=str(ngpu)).stdout.splitlines()[1].startswith("+ OMP_NUM_THREADS=3 ")


@pytest.mark.parametrize(
    "env, error",
    [
        (
            {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "x"},
            "error: NODE_RANK=2: this node's rank must be an integer in 0..1 (NNODES=2)",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "0"},
            "error: MASTER_ADDR is not set: the nodes need node 0's address to meet",
        ),
        ({"NNODES": "two"}, "error: NNODES=two: the number of nodes must be a positive integer"),
        (
            {"PET_NNODES": "2", "PET_MASTER_ADDR": "m"},
            "error: PET_NODE_RANK=<unset>: this node's rank must be an integer in 0..1",
        ),
        (
            {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "m", "MASTER_PORT": "99999"},
            "error: MASTER_PORT=99999: must be a TCP port number (1..65535)",
        ),
        ({"NGPU": "0"}, "error: NGPU=0: processes per node must be a positive integer"),
    ],
)
def test_bad_launch_variables_are_one_line_errors(env, error):
    out = _dry_run(**env)
    assert out.returncode == 2
    assert out.stderr.strip() == error or out.stderr.strip().startswith(error), out.stderr


# ----------------------------------------------------------------------------- two hosts

SUBNET = "10.231.7"


def _root_with_netns() -> str | None:
    """Why two network namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`): apt-get install iproute2"
    if shutil.which("unshare") is None:
        return "needs unshare (util-linux) to give each host its own hostname"
    probe = subprocess.run(["ip", "netns", "add", "tt_probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "tt_probe"], capture_output=True)
    return None


@pytest.fixture(scope="module")
def two_hosts():
    """Namespaces tt_host0 (SUBNET.1) and tt_host1 (SUBNET.2) on one veth link, whose
    processes run as hosts named tt-host0 and tt-host1. Both names resolve in both namespaces
    (``ip netns exec`` mounts /etc/netns/NAME/hosts over /etc/hosts): each host's gloo binds to
    its own address, and torchrun hands node 0's name to the workers as MASTER_ADDR, so that
    name must lead to node 0 from the other host too (with one shared hostname it led each
    node to itself, and the workers of node 1 waited forever)."""
    why = _root_with_netns()
    if why:
        pytest.skip(why)
    names = ["tt_host0", "tt_host1"]
    hosts = "".join(f"{SUBNET}.{i + 1} {_hostname(n)}\n" for i, n in enumerate(names))

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    def teardown() -> None:
        subprocess.run(["ip", "link", "del", "tt_veth0"], capture_output=True)
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            shutil.rmtree(f"/etc/netns/{name}", ignore_errors=True)

    teardown()  # what an interrupted earlier run left
    try:
        sh("ip", "link", "add", "tt_veth0", "type", "veth", "peer", "name", "tt_veth1")
        for i, name in enumerate(names):
            sh("ip", "netns", "add", name)
            sh("ip", "link", "set", f"tt_veth{i}", "netns", name)
            sh("ip", "-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", f"tt_veth{i}")
            sh("ip", "-n", name, "link", "set", f"tt_veth{i}", "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
            os.makedirs(f"/etc/netns/{name}", exist_ok=True)
            with open(f"/etc/netns/{name}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n{hosts}")
        yield names
    finally:
        teardown()


def _hostname(namespace: str) -> str:
    return namespace.replace("_", "-")


def _start_on_two_hosts(
    tmp_path: Path, hosts: list[str], node_env: list[dict[str, str]], args: list[str]
) -> list[subprocess.Popen]:
    """The launcher started in both namespaces at once, each as its own host (the pid of each
    process ends up the launcher's: ``ip netns exec``, ``unshare`` and ``sh`` exec)."""
    procs = []
    for host, extra in zip(hosts, node_env):
        env = {k: v for k, v in train_env(tmp_path).items() if not _is_launch_variable(k)}
        env.update(extra, NGPU="2")
        as_host = [
            "ip",
            "netns",
            "exec",
            host,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            _hostname(host),
        ]
        cmd = [*as_host, SCRIPT, "--job.dump_folder", str(tmp_path / "out"), *args]
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def _outputs(procs: list[subprocess.Popen], marker: str) -> list[str]:
    """Each launcher's output once it has ended; every process left is killed (the launchers'
    sessions, and by pid the workers whose command line holds ``marker``)."""
    try:
        return [proc.communicate(timeout=600)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in worker_pids(marker).values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _run_on_two_hosts(
    tmp_path: Path, hosts: list[str], node_env: list[dict[str, str]], args: list[str]
) -> list[str]:
    """Run the launcher in both namespaces at once; each one's output (both must succeed)."""
    procs = _start_on_two_hosts(tmp_path, hosts, node_env, args)
    outputs = _outputs(procs, str(tmp_path / "out"))
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 0, output[-4000:]
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("style", ["explicit", "kubeflow_pods", "kubeflow_pet"])
def test_two_hosts_train_as_one_job_of_four(tmp_path, two_hosts, one_host_losses, style):
    # explicit: node 0's address; Kubeflow: a name, as the operator's service name is
    master = f"{SUBNET}.1" if style == "explicit" else _hostname(two_hosts[0])
    per_node = {
        "explicit": lambda r: {
            "NNODES": "2",
            "NODE_RANK": str(r),
            "MASTER_ADDR": master,
            "MASTER_PORT": "29511",
        },
        "kubeflow_pods": lambda r: {
            "MASTER_ADDR": master,
            "MASTER_PORT": "29512",
            "WORLD_SIZE": "2",
            "RANK": str(r),
            "PYTHONUNBUFFERED": "0",
        },
        "kubeflow_pet": lambda r: {
            "PET_NNODES": "2",
            "PET_NODE_RANK": str(r),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": "29513",
            "PET_NPROC_PER_NODE": "2",
            "WORLD_SIZE": "4",
            "RANK": str(r),
            "MASTER_ADDR": master,
            "MASTER_PORT": "29513",
        },
    }[style]
    outputs = _run_on_two_hosts(tmp_path, two_hosts, [per_node(0), per_node(1)], FOUR_WORKER_ARGS)
    for rank, output in enumerate(outputs):
        assert f"nnodes=2 node_rank={rank} nproc_per_node=2 world_size=4" in output, output[:2000]
        assert "world_size=4 dp_replicate=1 dp_shard=4" in output, output[-2000:]
    losses = tensorboard_scalars(tmp_path / "out")
    assert sorted(losses) == [1, 2, 3, 4]
    for step, loss in losses.items():
        # the same FSDP 4 layout as on one host: the same reductions over gloo
        assert abs(loss - one_host_losses[step]) <= 1e-5, (step, loss, one_host_losses[step])


@pytest.mark.slow
def test_sigterm_to_one_pod_saves_every_rank_and_the_job_resumes(
    tmp_path, two_hosts, one_host_preempt_losses
):
    """What Kubernetes does to a pod it evicts: SIGTERM to that pod's launcher only. The other
    pod's workers learn of it at a step boundary; all four save the same step and both pods exit
    with 160; both started again resume there as if never stopped."""
    node_env = [
        {"NNODES": "2", "NODE_RANK": str(r), "MASTER_ADDR": f"{SUBNET}.1", "MASTER_PORT": "29514"}
        for r in (0, 1)
    ]
    out = tmp_path / "out"
    procs = _start_on_two_hosts(tmp_path, two_hosts, node_env, PREEMPT_ARGS)
    try:
        deadline = time.time() + 300
        while last_logged_step(out / "logs" / "rank_0.log") < 5:
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.1)
        os.kill(procs[1].pid, signal.SIGTERM)
    finally:
        outputs = _outputs(procs, str(out))
    saved = []
    for proc, output in zip(procs, outputs):
        assert proc.returncode == 160, output[-4000:]
        lines = [ln for ln in output.splitlines() if ln.startswith("preempted by SIGTERM after")]
        assert len(lines) == 1 and "Traceback" not in output, output[-4000:]
        saved.append(lines[0])
    assert saved[0] == saved[1], saved  # the same step, saved by every rank
    step = int(saved[0].split("after step ")[1].split(":")[0])
    assert saved[0].endswith(
        f"saved to {out}/checkpoint/step-{step}; start the job again to resume"
    )

    outputs = _run_on_two_hosts(tmp_path, two_hosts, node_env, PREEMPT_ARGS)
    assert f"Loaded training state from {out}/checkpoint/step-{step}" in outputs[0]
    losses = tensorboard_scalars_all_runs(out)
    assert sorted(losses) == list(range(1, 17))
    for s, loss in losses.items():
        assert abs(loss - one_host_preempt_losses[s]) <= 1e-6, (s, loss)
