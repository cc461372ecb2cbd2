"""Context parallel, in-process: the sequence layout and the configuration checks. The all-gather
attention against plain SDPA in 1, 2 and 4 processes is in tests/e2e/test_context_parallel.py,
whole training runs under CP in tests/e2e/test_parallel_equivalence.py."""

from __future__ import annotations

import pytest
import torch

from torchtitan.config.parse import parse_args
from torchtitan.distributed.context_parallel import chunk_ids, shard_sequence, unshard_sequence
from torchtitan.errors import ConfigError
from torchtitan.train.plan import plan_job


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


def _job(*args: str):
    return parse_args(["--training.seq_len", "64", *args])


@pytest.mark.parametrize(
    "args, world, expected",
    [
        (
            ["--parallelism.context_parallel_degree", "3", "--training.seq_len", "64"],
            3,
            "training.seq_len: 64 must be divisible by 2 x parallelism.context_parallel_degree = 6",
        ),
        (
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "4",
                "--training.seq_len",
                "36",
            ],
            8,
            "training.seq_len: 36 / context_parallel_degree 2 = 18 tokens per rank must be divisible by parallelism.tensor_parallel_degree = 4",
        ),
    ],
)
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
