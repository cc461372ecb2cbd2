"""The two lanes of a ``pytest -n 2`` run (pytest-xdist): which worker runs which test.

* the process lane: every test that starts several training processes (the warm pools, torchrun,
  the launchers, Slurm), all in one scope, so on one worker, one test at a time, in file order;
* the in-process lane: the rest (the unit tier, scripts and launches of one process), each test a
  scope of its own, so the other worker runs them while the process lane leaves a core idle.

Two multi-process tests at a time on two cores measured 61% slower each (``--dist loadfile``,
docs/getting_started.md): the lanes never run two of them at once. (xdist's own ``loadgroup``
does not group under pytest 9.2: it renames ``item._nodeid``, which pytest 9.2 no longer reads.)
Nor do the process lane's one-process tests join the in-process lane: moving 21 of them (180 s
run one at a time) there made the layout sweep beside them take 413 s against 235 s
(2026-11-27, clean clones of edd7c00 and 23ce8ce, cold caches): four gloo ranks on two cores
wait in every collective for whichever rank another process has pushed off its core.

Yet four gloo ranks on two cores leave about a third of the machine idle (3 ranks waiting in a
collective for the fourth), and running the in-process lane first instead, the process lane
alone after it, was slower: pytest 1925 s against 1807 s (2026-11-28, clean clones of 08073fb).
So the in-process lane runs beside the process lane at ``SCHED_IDLE`` (:func:`cpu_priority`): on
the idle cycles only, the ranks taking their core back as they wake. The parallel-equivalence
suite beside the unit tier and the memory estimator's tests (warm caches, ``-n 2``): 123 s at
idle priority, 192 s at the normal one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from xdist.scheduler import LoadScopeScheduling

PROCESSES = "processes"
# e2e files whose tests start at most one training or script process and use no pool
ONE_PROCESS_E2E = frozenset(
    {
        "test_config.py",
        "test_data_errors.py",
        "test_dataloader_throughput.py",
        "test_estimate_memory.py",
        "test_loss_compare.py",
        "test_mla_benchmark.py",
        "test_tokenizer.py",
        "test_upstream_configs.py",
    }
)


# tests of the process lane's files that start at most one process and use no pool (without
# their parameters): one core each, so they run beside the process lane at idle priority
ONE_PROCESS_TESTS = frozenset(
    {
        "tests/e2e/test_moe_parallel.py::test_blocks_compiled_with_inductor_give_eager_gradients",
        "tests/e2e/test_norms.py::test_compiled_matches_eager",
        "tests/e2e/test_norms.py::test_fused_rmsnorm_refused_on_cpu",
        "tests/e2e/test_norms.py::test_model_logits_identical_across_norm_types",
        "tests/e2e/test_norms.py::test_benchmark_script_json",
        "tests/e2e/test_train_e2e.py::test_deterministic_cpu_runs_repeat_bit_for_bit",
        "tests/e2e/test_train_e2e.py::test_print_config_and_unset_seed_is_drawn_and_logged",
        "tests/e2e/test_train_e2e.py::test_llama2_with_sentencepiece_tokenizer_trains",
        "tests/e2e/test_train_e2e.py::test_step_one_every_log_freq_and_the_last_step_are_logged",
    }
)


def lane(nodeid: str) -> str:
    """``PROCESSES`` for a test of the process lane, else the test's own id."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/unit/"):
        return nodeid
    if path.startswith("tests/e2e/") and path.rsplit("/", 1)[-1] in ONE_PROCESS_E2E:
        return nodeid
    if nodeid.split("[")[0] in ONE_PROCESS_TESTS:
        return nodeid
    return PROCESSES


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with :func:`lane` as the scope: the largest scope (the process
    lane) goes to one worker first, the single tests to whichever worker is free."""

    def _split_scope(self, nodeid: str) -> str:
        return lane(nodeid)


@contextlib.contextmanager
def cpu_priority(nodeid: str, alone: bool) -> Iterator[None]:
    """A test of the in-process lane (and every process it starts) at ``SCHED_IDLE``: it runs on
    the cycles the process lane leaves idle, and a process-lane rank that wakes takes the core
    back at once, so the lockstep ranks are not slowed by it. The process lane's tests, and tests
    that hold the machine alone, keep the normal policy."""
    idle = lane(nodeid) != PROCESSES and not alone and os.environ.get("TT_IDLE_LANE", "1") == "1"
    if not idle or not hasattr(os, "SCHED_IDLE"):
        yield
        return
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    try:
        yield
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
