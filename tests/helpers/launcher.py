"""Shared by the e2e and ops tests: start ``run_llama_train.sh`` for real, read what it logged."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace

from repo_paths import DEBUG_TOML, ROOT

# A short FSDP-4 training that the launching tests run on one host and spread over two.
FOUR_WORKER_ARGS = [
    "--training.steps",
    "4",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--training.local_batch_size",
    "2",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "42",
    "--debug.deterministic",
]
# A longer run of the same job with checkpoints, that the preemption tests stop and resume: what it
# saves is the preemption's save and the last step's.
PREEMPT_ARGS = [
    *FOUR_WORKER_ARGS,
    "--training.steps=16",
    "--checkpoint.enable=true",
    "--checkpoint.interval=1000",
]
# The equivalence proofs (tests/e2e/test_parallel_equivalence.py, test_qwen3_parallel.py): every
# layout trains EQUIVALENCE_STEPS steps of a global batch of 8 sequences, seeded, deterministic.
EQUIVALENCE_STEPS = 8
# The optimizer has four parameter groups in every layout (decay or not, attention at half the
# learning rate), which each parallelism must carry like the single process does.
# pipeline parallel 2 with the 1F1B schedule and micro-batches of 2 (the layout suites' PP2)
PP2_1F1B = [
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "1F1B",
    "--parallelism.pipeline_parallel_microbatch_size",
    "2",
]
# Blocks (and the loss) compiled with the aot_eager backend: dynamo's graph capture and
# AOTAutograd's forward and backward graphs with the parallelisms' DTensors and hooks, as with
# inductor, without inductor's C++ code generation (on this 2-core VM: 25 s against 82 s for the
# cp2_tp2 layout). The layouts that keep inductor, and the one-process inductor-against-eager
# checks of each family, are listed in docs/getting_started.md (tests).
COMPILE_AOT_EAGER = ["--compile.enable", "--compile.backend", "aot_eager"]


def local_batch(n: int) -> list[str]:
    return ["--training.local_batch_size", str(n)]


def expert_parallel(n: int) -> list[str]:
    return ["--parallelism.expert_parallel_degree", str(n)]


EQUIVALENCE_ARGS = [
    "--training.steps",
    str(EQUIVALENCE_STEPS),
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "8",
    "--lr_scheduler.warmup_steps",
    "2",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "42",
    "--debug.deterministic",
    "--optimizer.weight_decay_exempt",
    "norms,biases,embeddings,output",
    "--optimizer.param_groups",
    '[{"match": "layers.*.attention*", "lr_multiplier": 0.5}]',
]
# The layout and checkpoint suites train their family's debug model cut to 2 blocks: a layout
# shards, splits, recomputes or saves every block alike, and two still give FSDP a next block to
# prefetch, each pipeline stage a block and selective checkpointing one block recomputed beside
# one kept. Each block adds its collectives to every step: four ranks on two cores trained the 8
# steps of FSDP2 x TP2 in 3.5 s against 7.8 s with the dense model's 6. The layout sweep trains
# the 4-block models.
LAYOUT_SUITE_N_BLOCKS = 2
LAYOUT_SUITE_BLOCKS = ["--model.n_layers", str(LAYOUT_SUITE_N_BLOCKS)]
# the layout suites' common arguments: the equivalence settings on the 2-block models
LAYOUT_SUITE_ARGS = [*EQUIVALENCE_ARGS, *LAYOUT_SUITE_BLOCKS]
# the launcher's torchrun (torchtitan/resilience/torchrun.py) and torchrun itself, not workers
TORCHRUN = {"torchtitan.resilience.torchrun", "torch.distributed.run"}
STEP_RE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


def launch(
    tmp_path: Path, *args: str, ngpu: int = 1, timeout: int = 600, **env: str
) -> subprocess.CompletedProcess:
    """``NGPU=ngpu ./run_llama_train.sh --job.dump_folder tmp_path/out args``, offline, on CPU
    (``env``: variables set for it)."""
    cmd = [str(ROOT / "run_llama_train.sh"), "--job.dump_folder", str(tmp_path / "out"), *args]
    env = train_env(tmp_path, NGPU=str(ngpu), **env)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def start(tmp_path: Path, *args: str, ngpu: int, **env: str) -> subprocess.Popen:
    """``launch`` in the background, in a session of its own, its output on one pipe."""
    cmd = [str(ROOT / "run_llama_train.sh"), "--job.dump_folder", str(tmp_path / "out"), *args]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=train_env(tmp_path, NGPU=str(ngpu), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def last_logged_step(log: Path) -> int:
    """The last step a rank's log file shows (0 before the first; rank 0 logs them)."""
    text = log.read_text() if log.exists() else ""
    return max((int(s) for s, _ in STEP_RE.findall(text)), default=0)


def _children() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of every process on the machine, from ``/proc``."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def descendants(*pids: int) -> set[int]:
    """The processes below ``pids``, whatever session they moved to (torchrun's workers and a
    launcher's torchrun each start one of their own); one walk of ``/proc``."""
    tree, found, todo = _children(), set(), list(pids)
    while todo:
        for child in tree.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def orphans(marker: str) -> dict[int, str]:
    """``{pid: command line}`` of the live processes whose command line holds ``marker`` and which
    are not below this one: what a test that started them left running after it ended."""
    ours = descendants(os.getpid()) | {os.getpid()}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours or not running(int(entry.name)):
            continue
        args = _cmdline(entry)
        if args is not None and any(marker in a for a in args):
            found[int(entry.name)] = " ".join(args).strip()
    return found


def _cmdline(entry: Path) -> list[str] | None:
    """A ``/proc/<pid>`` entry's arguments, or None when the process is gone."""
    try:
        return [a.decode(errors="replace") for a in (entry / "cmdline").read_bytes().split(b"\0")]
    except OSError:
        return None


def _signal(pids: Iterable[int], *sigs: signal.Signals) -> None:
    for pid in pids:
        for sig in sigs:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def kill_all(procs: list[subprocess.Popen], pids: Iterable[int] = ()) -> None:
    """Every process a test started: ``procs``, everything below them (stopped first, so that no
    torchrun restarts a worker while they die) and ``pids``, killed; then ``procs`` reaped."""
    tree = {p.pid for p in procs if p.poll() is None}  # a reaped one's pid may be another's
    for _ in range(3):  # a process forked between the walk and the stop is caught by the next
        tree |= descendants(*tree)
        _signal(tree, signal.SIGSTOP)
    _signal([*tree, *pids], signal.SIGKILL, signal.SIGCONT)
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait(timeout=60)


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def worker_pids(marker: str) -> dict[int, int]:
    """``{RANK: pid}`` of the train.py worker processes whose command line contains ``marker``."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        args = _cmdline(entry)
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if args is None:
            continue
        if any(a.endswith("train.py") for a in args) and not TORCHRUN.intersection(args):
            if any(marker in a for a in args):
                rank = next((e[5:] for e in env if e.startswith(b"RANK=")), b"-1")
                pids[int(rank)] = int(entry.name)
    return dict(sorted(pids.items()))


def cpu_worker_threads(nprocs: int) -> int:
    """The intra-op threads ``run_llama_train.sh`` gives each of ``nprocs`` CPU workers: the
    cores this process may use (``nproc``) divided by the workers, at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max((cores or 1) // nprocs, 1)


def train_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a test run: offline, caches under ``tmp_path``, this Python."""
    env = dict(os.environ)
    env.update(
        **cache_env(tmp_path),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHON=sys.executable,
    )
    env.update(extra)
    return env


def cache_env(tmp_path: Path) -> dict[str, str]:
    """Where a test run's workers keep the built corpora (``TORCHTITAN_CACHE``) and the
    ``datasets`` cache: one folder shared by the whole pytest session when conftest set
    ``TORCHTITAN_TEST_SHARED_CACHE`` (building the python_docs corpus costs each cold launch
    seconds per rank), else folders under ``tmp_path``. A test about cold caches passes its own."""
    base = Path(os.environ.get("TORCHTITAN_TEST_SHARED_CACHE") or tmp_path)
    return {"TORCHTITAN_CACHE": str(base / "cache"), "HF_DATASETS_CACHE": str(base / "hf")}


def console_losses(stdout: str) -> dict[int, float]:
    """``{step: loss}`` from the console lines (4 decimals)."""
    return {int(s): float(v) for s, v in STEP_RE.findall(stdout)}


def tensorboard_run(dump_folder: Path):
    """The loaded ``EventAccumulator`` of the only TensorBoard run under ``dump_folder/tb``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((dump_folder / "tb").iterdir())
    assert len(runs) == 1, runs
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    return acc


def tensorboard_scalars(dump_folder: Path, tag: str = "loss") -> dict[int, float]:
    """``{step: value}`` of one scalar from the only TensorBoard run under ``dump_folder/tb``."""
    return {e.step: e.value for e in tensorboard_run(dump_folder).Scalars(tag)}


def tensorboard_scalars_all_runs(dump_folder: Path, tag: str = "loss") -> dict[int, float]:
    """``{step: value}`` over every TensorBoard run under ``dump_folder/tb`` (a resumed job
    writes a new run), later runs overriding earlier ones."""
    from torchtitan.observability.tb_events import read_scalars

    return read_scalars(dump_folder, tag)


def pooled(
    pools, tmp_path: Path, *args: str, ngpu: int = 1, config: str | None = None
) -> SimpleNamespace:
    """``launch`` in the session's warm pool of ``ngpu`` ranks (tests/helpers/pool.py):
    ``train.py``'s ``train()`` with ``--job.dump_folder tmp_path/out args`` and ``config`` (the
    launcher's ``CONFIG_FILE``, default the debug model). ``returncode`` 0 and, as ``stdout``,
    what this run added to rank 0's log; a failing run raises the pool's CaseFailed."""
    out = tmp_path / "out"
    config = config or DEBUG_TOML
    log = out / "logs" / "rank_0.log"
    start = log.stat().st_size if log.exists() else 0
    compiles = any(a.startswith("--compile.enable") for a in args)
    full = ["--job.config_file", config, *args]
    pools(ngpu).run("pool_cases:train", full, str(out), meshes=True, compiles=compiles)
    with open(log) as f:
        f.seek(start)
        return SimpleNamespace(returncode=0, stdout=f.read(), stderr="")
