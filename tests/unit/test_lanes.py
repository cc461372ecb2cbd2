"""The lanes of a ``pytest -n 2`` run (tests/helpers/lanes.py)."""

from __future__ import annotations

import ast
import os

from lanes import BESIDE_TESTS, ONE_PROCESS_E2E, PROCESSES, lane, process_threads
from repo_paths import ROOT

# a pool, four ranks, or a clock
_NOT_BESIDE = ("pools", "ngpu=4", "NGPU", "nproc-per-node=4", "time.", "monotonic", "perf_counter")


def test_multi_process_tests_share_one_scope_and_the_rest_stand_alone():
    assert lane("tests/e2e/test_checkpoint.py::test_x[a]") == PROCESSES
    assert lane("tests/ops/test_slurm.py::test_y") == PROCESSES
    assert lane("tests/e2e/test_config.py::test_z") == "tests/e2e/test_config.py::test_z"
    assert (
        lane("tests/unit/data/test_mixture.py::test_w") == "tests/unit/data/test_mixture.py::test_w"
    )
    one = "tests/e2e/test_norms.py::test_compiled_matches_eager[torch.float32]"
    assert lane(one) == one
    assert lane("tests/e2e/test_moe_parallel.py::test_moe_layout_matches_one_process[ep2]") == (
        PROCESSES
    )


def test_the_in_process_e2e_files_exist_and_use_no_pool():
    """A file named there that went away, or took up the pools or torchrun since, would run its
    processes beside the process lane's."""
    for name in sorted(ONE_PROCESS_E2E):
        text = (ROOT / "tests" / "e2e" / name).read_text()
        for marker in ("pools", "torch.distributed.run", "ngpu=2", "ngpu=4", "NGPU"):
            assert marker not in text, (name, marker)


def test_the_tests_beside_the_process_lane_exist_and_use_no_pool_four_ranks_or_clock():
    """Each named test function is in its file, and neither starts a pool or four ranks nor
    reads the time (at idle priority its steps may wait)."""
    for entry in sorted(BESIDE_TESTS):
        path, name = entry.split("::")
        source = (ROOT / path).read_text()
        found = [
            node
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name == name
        ]
        assert len(found) == 1, entry
        body = ast.get_source_segment(source, found[0])
        for marker in _NOT_BESIDE:
            assert marker not in body, (entry, marker)


def test_the_process_lane_starts_one_thread_processes_beside_the_other_lane(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    multi = "tests/e2e/test_checkpoint.py::test_x[a]"
    with process_threads(multi, alone=False):
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in os.environ
    for nodeid, alone in ((multi, True), ("tests/unit/test_lanes.py::test_y", False)):
        with process_threads(nodeid, alone):
            assert "OMP_NUM_THREADS" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's own setting wins
    with process_threads(multi, alone=False):
        assert os.environ["OMP_NUM_THREADS"] == "3"
