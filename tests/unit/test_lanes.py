"""The lanes of a ``pytest -n 2`` run (tests/helpers/lanes.py)."""

from __future__ import annotations

from lanes import ONE_PROCESS_E2E, PROCESSES, lane
from repo_paths import ROOT


def test_multi_process_tests_share_one_scope_and_the_rest_stand_alone():
    assert lane("tests/e2e/test_checkpoint.py::test_x[a]") == PROCESSES
    assert lane("tests/ops/test_slurm.py::test_y") == PROCESSES
    assert lane("tests/e2e/test_config.py::test_z") == "tests/e2e/test_config.py::test_z"
    assert (
        lane("tests/unit/data/test_mixture.py::test_w") == "tests/unit/data/test_mixture.py::test_w"
    )


def test_the_in_process_e2e_files_exist_and_use_no_pool():
    """A file named there that went away, or took up the pools or torchrun since, would run its
    processes beside the process lane's."""
    for name in sorted(ONE_PROCESS_E2E):
        text = (ROOT / "tests" / "e2e" / name).read_text()
        for marker in ("pools", "torch.distributed.run", "ngpu=2", "ngpu=4", "NGPU"):
            assert marker not in text, (name, marker)
