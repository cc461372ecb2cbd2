"""The lanes of a ``pytest -n 2`` run (tests/helpers/lanes.py)."""

from __future__ import annotations

import ast
import re

from lanes import ONE_PROCESS_E2E, ONE_PROCESS_TESTS, PROCESSES, lane
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


def test_single_tests_of_the_process_files_exist_and_start_one_process():
    """Each test named in ONE_PROCESS_TESTS is there and asks for no more than one process: a
    rename would send it back to the process lane unnoticed, and a second rank added since would
    run beside the process lane's tests."""
    multi = re.compile(r"ngpu\s*=\s*(?!1\b)|pools\((?!1\))|torch\.distributed\.run|NGPU|nproc")
    for name, tests in sorted(ONE_PROCESS_TESTS.items()):
        source = (ROOT / "tests" / "e2e" / name).read_text()
        functions = {
            node.name: ast.get_source_segment(source, node)
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef)
        }
        for test in tests:
            assert test in functions, (name, test)
            found = multi.search(functions[test])
            assert found is None, (name, test, found and found.group(0))
            assert lane(f"tests/e2e/{name}::{test}[x]") != PROCESSES
