"""Context parallel: the sequence layout (in-process), the all-gather attention against plain
SDPA in 1, 2 and 4 processes (tests/cp_worker.py; on a GPU also with the CUDA kernels), and the
configuration checks. Whole training runs under CP are in tests/test_parallel_equivalence.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchtitan.config_manager import parse_args
from torchtitan.distributed.context_parallel import chunk_ids, shard_sequence, unshard_sequence
from torchtitan.errors import ConfigError
from torchtitan.job_plan import plan_job

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_then_unshard_is_the_identity(cp):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    parts = torch.stack([shard_sequence(x, cp, r, dim=1) for r in range(cp)])
    assert parts.shape == (cp, 2, 24 // cp, 3)
    assert torch.equal(unshard_sequence(parts, cp, dim=1), x)


def test_every_chunk_is_held_once_and_causal_work_is_balanced():
    cp = 4
    held = sorted(c for r in range(cp) for c in chunk_ids(cp, r))
    assert held == list(range(2 * cp))
    # chunk i attends to i + 1 chunks (itself and every earlier one): the same per rank
    work = {sum(c + 1 for c in chunk_ids(cp, r)) for r in range(cp)}
    assert work == {2 * cp + 1}
    assert torch.equal(shard_sequence(torch.arange(16), cp, 1, dim=0), torch.tensor([2, 3, 12, 13]))


def test_a_sequence_that_does_not_split_into_2cp_chunks_is_refused():
    with pytest.raises(ValueError, match="sequence length 10 is not divisible into 2 x cp = 4"):
        shard_sequence(torch.zeros(1, 10), 2, 0)


def _run_worker(nproc: int, *args: str, timeout: int = 300) -> dict[str, list[float]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", str(ROOT / "tests" / "cp_worker.py"), *args]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            name, *errs = line.split()[1:]
            results[name] = [float(e) for e in errs]
    return results


def _assert_close(results: dict[str, list[float]], n_cases: int) -> None:
    assert len(results) == n_cases, results
    for name, (cp_out, cp_grad, sdpa_out, sdpa_grad) in results.items():
        if sdpa_out == 0.0:  # float32: plain SDPA is the reference itself
            assert cp_out < 1e-5 and cp_grad < 1e-5, (name, cp_out, cp_grad)
        else:  # 16-bit: no worse than plain SDPA in that dtype, give or take rounding
            assert cp_out <= 2 * sdpa_out + 1e-3, (name, cp_out, sdpa_out)
            assert cp_grad <= 2 * sdpa_grad + 1e-3, (name, cp_grad, sdpa_grad)


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_all_gather_attention_matches_sdpa(nproc):
    """Outputs and q/k/v gradients of the whole sequence, gathered from every rank's part."""
    _assert_close(_run_worker(nproc), n_cases=3)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (flash / efficient kernels)"
)
def test_all_gather_attention_matches_sdpa_on_cuda():
    _assert_close(_run_worker(1, "--cuda"), n_cases=3)


def _job(*args: str):
    return parse_args(["--training.seq_len", "64", *args])


@pytest.mark.parametrize(
    "args, world, expected",
    [
        (["--parallelism.context_parallel_degree", "3", "--training.seq_len", "64"], 3,
         "training.seq_len: 64 must be divisible by 2 x parallelism.context_parallel_degree = 6"),
        (["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree",
          "4", "--training.seq_len", "36"], 8,
         "training.seq_len: 36 / context_parallel_degree 2 = 18 tokens per rank must be divisible by parallelism.tensor_parallel_degree = 4"),
    ],
)  # fmt: skip
def test_sequence_split_errors_name_the_key(args, world, expected):
    with pytest.raises(ConfigError) as e:
        plan_job(_job(*args), world_size=world)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_cp_ranks_form_the_fsdp_and_loss_groups_but_not_the_data_groups():
    plan = plan_job(_job("--parallelism.context_parallel_degree", "2"), world_size=8)
    d = plan.dims
    assert (d.dp_shard, d.cp, d.dp) == (4, 2, 4)
    assert d.fsdp_enabled and d.non_data_parallel_size == 2
    assert plan.global_batch_size == 4 * _job().training.local_batch_size
