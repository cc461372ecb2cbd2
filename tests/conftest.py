"""Fixtures shared by several test files."""

from __future__ import annotations

import pytest
from launcher import FOUR_WORKER_ARGS, launch, tensorboard_scalars


@pytest.fixture(scope="session")
def one_host_losses(tmp_path_factory) -> dict[int, float]:
    """Per-step losses of FOUR_WORKER_ARGS as 4 processes on one machine: what the same job
    spread over several hosts (network namespaces, a Slurm cluster) must reproduce."""
    tmp = tmp_path_factory.mktemp("one_host")
    out = launch(tmp, *FOUR_WORKER_ARGS, ngpu=4)
    assert out.returncode == 0, out.stderr[-3000:]
    return tensorboard_scalars(tmp / "out")
