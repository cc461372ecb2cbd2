"""Fixtures shared by several test files.

The tiers: tests/unit (no processes), tests/e2e (real processes: training runs, torchrun, scripts),
tests/ops (Slurm, network namespaces, the container image, deploy files). Their shared helpers are
in tests/helpers, on the path of every run (``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import os
import sys

# Every e2e test starts Python processes that import torch. Where PYTHONDONTWRITEBYTECODE is set
# (as in many CI images) nothing imported is ever cached as .pyc, so each process compiles torch's
# modules again: `import torch` took 4.7 s against 1.9 s on the 2-core VM, and the launcher, Slurm
# and preemption tests 791 s against 436 s on a clean clone (docs/getting_started.md: tests).
# The suite and the processes it starts cache their bytecode.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The Ctrl-C tests send SIGINT to the trainers they start. A shell that runs the suite in the
# background without job control (``bash .ci/run &`` in a script) has it ignored, and an ignored
# signal stays ignored in every process started from here: the trainers never see the Ctrl-C.
# Python's own handler instead (children start with the default action again).
import signal  # noqa: E402

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import shutil  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# Helpers whose checks are asserts: pytest's detailed assertion messages there as in a test file.
pytest.register_assert_rewrite("download_scripts", "norm_checks")

from launcher import FOUR_WORKER_ARGS, PREEMPT_ARGS, pooled, tensorboard_scalars  # noqa: E402
from machine_lock import Hold  # noqa: E402

# ----------------------------------------------------------------------- two lanes (`-n 2`)
# CI runs the suite in two pytest-xdist workers as two lanes (tests/helpers/lanes.py): the tests
# that start several processes on one worker one at a time, the others beside them on the idle
# cycles (SCHED_IDLE). Tests marked `exclusive` (timing, CPU load, fixed ports) run with the
# machine to themselves: the other worker finishes its test and waits
# (tests/helpers/machine_lock.py).
_EXCLUSIVE = {  # file -> why it runs alone
    "tests/e2e/test_stragglers.py": "a CPU hog pinned beside one rank; other load makes stragglers",
    "tests/e2e/test_resilience.py": "a collective timeout and the hang watchdog, timed",
    "tests/unit/resilience/test_stragglers.py": "step times and CPU shares are measured",
    "tests/unit/resilience/test_watchdog.py": "sub-second timeouts of the watchdog's thread",
    "tests/ops/test_launching.py": "fixed ports, network-namespace hosts, timed signals",
    "tests/ops/test_slurm.py": "a Slurm cluster's daemons on fixed ports",
    "tests/ops/test_image_build.py": "a container image build (opt-in)",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    from lanes import LaneScheduling

    return LaneScheduling(config, log)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        path = item.nodeid.split("::")[0]
        if path in _EXCLUSIVE:
            item.add_marker(pytest.mark.exclusive)
    if _WORKER:
        from lanes import PROCESSES, lane

        # the process lane's exclusive tests at its end: by then the in-process lane has ended
        # or nearly, and it is not kept waiting in the middle
        items.sort(
            key=lambda item: (
                lane(item.nodeid) == PROCESSES and item.get_closest_marker("exclusive") is not None
            )
        )


_LOCKS = "TORCHTITAN_TEST_LOCKS"  # the lock files' folder, made by the xdist controller
_WORKER = "PYTEST_XDIST_WORKER" in os.environ  # this process is one of xdist's workers


def pytest_configure(config) -> None:
    if _WORKER:
        torch.set_num_threads(1)  # two workers on two cores: one intra-op thread each
    elif config.getoption("numprocesses", None):
        os.environ[_LOCKS] = tempfile.mkdtemp(prefix="torchtitan-tests-")  # workers inherit it


def pytest_unconfigure(config) -> None:
    if _HOLD is not None:
        _HOLD.release()
    if not _WORKER and _LOCKS in os.environ:
        shutil.rmtree(os.environ.pop(_LOCKS), ignore_errors=True)


_HOLD: Hold | None = None  # this worker's hold on the machine, test after test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under xdist, each test (its fixtures' setup and teardown included) holds the machine
    shared, or alone where it is marked ``exclusive`` (kept alone into the next test when that
    one is ``exclusive`` too); a test of the in-process lane runs at
    idle priority (:func:`lanes.cpu_priority`), and the processes a test of the other lane starts
    use one intra-op thread each (:func:`lanes.process_threads`)."""
    folder = os.environ.get(_LOCKS) if _WORKER else None
    if folder is None:
        yield
        return
    from lanes import cpu_priority, process_threads

    global _HOLD
    _HOLD = _HOLD or Hold(Path(folder))
    alone = item.get_closest_marker("exclusive") is not None
    next_alone = nextitem is not None and nextitem.get_closest_marker("exclusive") is not None
    with (
        _HOLD.test(alone, keep_alone=next_alone),
        cpu_priority(item.nodeid, alone),
        process_threads(item.nodeid, alone),
    ):
        yield


@pytest.fixture(scope="session", autouse=True)
def shared_cache(tmp_path_factory):
    """One corpus and ``datasets`` cache for every training run of the session (see
    ``launcher.cache_env``): each launch otherwise rebuilds the python_docs corpus on every rank."""
    folder = tmp_path_factory.mktemp("shared_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHTITAN_TEST_SHARED_CACHE", str(folder))
        yield folder


@pytest.fixture(autouse=True)
def no_process_left_behind(request, tmp_path_factory):
    """After each test of the process tiers, the processes it started and did not stop (a
    torchrun in a session of its own whose workers outlived a kill, say) are killed, with a
    warning naming them: left alone they take the cores from every later test."""
    yield
    if request.node.nodeid.startswith(("tests/e2e/", "tests/ops/")):
        from launcher import kill_all, orphans

        left = orphans(f"{tmp_path_factory.getbasetemp()}/")
        if left:
            kill_all([], pids=left)
            lines = "; ".join(f"{pid}: {cmd[:200]}" for pid, cmd in left.items())
            warnings.warn(f"{len(left)} processes left running, killed: {lines}", stacklevel=1)


@pytest.fixture(scope="session")
def one_host_preempt_losses(pools, tmp_path_factory) -> dict[int, float]:
    """Per-step losses of PREEMPT_ARGS as 4 processes on one machine, unbroken: what a preempted
    and resumed job (on a Slurm cluster, on two network-namespace hosts) must reproduce. Trained
    in the warm pool of 4 ranks, whose losses are the launcher's bit for bit
    (tests/e2e/test_pool.py): a launch of 4 workers would cost a start-up of 5 processes."""
    tmp = tmp_path_factory.mktemp("one_host_preempt")
    pooled(pools, tmp, *PREEMPT_ARGS, ngpu=4)
    return tensorboard_scalars(tmp / "out")


@pytest.fixture(scope="session")
def one_host_losses(pools, tmp_path_factory) -> dict[int, float]:
    """Per-step losses of FOUR_WORKER_ARGS as 4 processes on one machine: what the same job
    spread over several hosts (network namespaces, a Slurm cluster) must reproduce. In the warm
    pool, as ``one_host_preempt_losses``."""
    tmp = tmp_path_factory.mktemp("one_host")
    pooled(pools, tmp, *FOUR_WORKER_ARGS, ngpu=4)
    return tensorboard_scalars(tmp / "out")


@pytest.fixture
def one_cpu_thread():
    """Tiny models: one intra-op thread is as fast, and it does not slow down by an order of
    magnitude when other processes keep the cores busy (thread oversubscription). Use with
    ``pytestmark = pytest.mark.usefixtures("one_cpu_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def pools(tmp_path_factory):
    """``pools(n)``: the session's warm pool of ``n`` ranks (tests/helpers/pool.py), started at
    its first case, with the test runs' offline environment and shared caches, and the intra-op
    threads ``NGPU=n ./run_llama_train.sh`` gives CPU workers (the cores divided by ``n``)."""
    from launcher import cpu_worker_threads, train_env
    from pool import WorkerPool

    made: dict[int, WorkerPool] = {}
    folder = tmp_path_factory.mktemp("pools")

    def get(n: int) -> WorkerPool:
        if n not in made:
            threads = os.environ.get("OMP_NUM_THREADS") or str(cpu_worker_threads(n))
            env = train_env(folder, OMP_NUM_THREADS=threads)
            made[n] = WorkerPool(n, env=env, case_timeout_s=900)
        return made[n]

    yield get
    for pool in made.values():
        pool.shutdown()


_SECONDS: dict[str, dict[str, list]] = {"tier": {}, "file": {}}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Adds each test's setup, call and teardown time to its tier (tests/<tier>/...) and file."""
    path = report.nodeid.split("::")[0]
    parts = path.split("/")
    tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    counted = report.when == "call" or (report.when == "setup" and report.skipped)
    for kind, key in (("tier", tier), ("file", path)):
        entry = _SECONDS[kind].setdefault(key, [0.0, 0])
        entry[0] += report.duration
        entry[1] += counted


def pytest_terminal_summary(terminalreporter) -> None:
    """Where a run's minutes went, after the slowest tests: the time per tier, and the files
    that took the most."""
    if not _SECONDS["tier"]:
        return
    terminalreporter.section("time per tier")
    for tier, (seconds, count) in sorted(_SECONDS["tier"].items()):
        terminalreporter.write_line(f"{tier:<6} {count:>5} tests {seconds:>8.1f} s")
    terminalreporter.section("slowest files")
    files = sorted(_SECONDS["file"].items(), key=lambda kv: -kv[1][0])
    for path, (seconds, count) in files[:20]:
        terminalreporter.write_line(f"{seconds:>8.1f} s {count:>5} tests  {path}")
