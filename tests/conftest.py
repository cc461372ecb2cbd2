"""Fixtures shared by several test files.

The tiers: tests/unit (no processes), tests/e2e (real processes: training runs, torchrun, scripts),
tests/ops (Slurm, network namespaces, the container image, deploy files). Their shared helpers are
in tests/helpers, on the path of every run (``pythonpath`` in pyproject.toml)."""

from __future__ import annotations

import pytest
import torch

# Helpers whose checks are asserts: pytest's detailed assertion messages there as in a test file.
pytest.register_assert_rewrite("download_scripts", "norm_checks")

from launcher import FOUR_WORKER_ARGS, launch, tensorboard_scalars  # noqa: E402


@pytest.fixture(scope="session")
def one_host_losses(tmp_path_factory) -> dict[int, float]:
    """Per-step losses of FOUR_WORKER_ARGS as 4 processes on one machine: what the same job
    spread over several hosts (network namespaces, a Slurm cluster) must reproduce."""
    tmp = tmp_path_factory.mktemp("one_host")
    out = launch(tmp, *FOUR_WORKER_ARGS, ngpu=4)
    assert out.returncode == 0, out.stderr[-3000:]
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
