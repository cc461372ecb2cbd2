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
"""

from __future__ import annotations

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


def lane(nodeid: str) -> str:
    """``PROCESSES`` for a test of the process lane, else the test's own id."""
    path = nodeid.split("::")[0]
    if path.startswith("tests/unit/"):
        return nodeid
    if path.startswith("tests/e2e/") and path.rsplit("/", 1)[-1] in ONE_PROCESS_E2E:
        return nodeid
    return PROCESSES


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with :func:`lane` as the scope: the largest scope (the process
    lane) goes to one worker first, the single tests to whichever worker is free."""

    def _split_scope(self, nodeid: str) -> str:
        return lane(nodeid)
