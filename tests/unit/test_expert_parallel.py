"""Expert parallelism without processes: the regrouping of the rows an all-to-all delivers, and
the one-line errors of layouts that cannot split the experts. (The numbers of real EP runs
against one process are in tests/e2e/test_moe_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from torchtitan.config_manager import parse_args
from torchtitan.distributed.expert_parallel import regroup_index
from torchtitan.errors import ConfigError
from torchtitan.job_plan import plan_job

L4 = ["--job.config_file", "train_configs/llama4_debug.toml"]


@pytest.mark.parametrize(
    "counts", [[[2, 0, 1], [1, 3, 0]], [[0, 0], [0, 4]], [[5]], [[0, 1, 2, 3]]]
)
def test_regroup_index_orders_rank_major_blocks_expert_major(counts):
    """Rows arrive source rank by source rank, each rank's block expert by expert; the grouped
    matmul wants expert by expert, rank by rank."""
    counts = torch.tensor(counts)
    rows, label = [], []
    for src in range(counts.shape[0]):  # the order the all-to-all delivers
        for e in range(counts.shape[1]):
            for i in range(int(counts[src, e])):
                label.append((e, src, i))
    want = sorted(label)  # expert, then source rank, then arrival order
    rows = torch.arange(len(label))
    got = [label[i] for i in rows[regroup_index(counts)].tolist()]
    assert got == want


@pytest.mark.parametrize(
    "world, args, words",
    [
        (3, ["--parallelism.expert_parallel_degree", "3"],
         "expert_parallel_degree: 3 does not divide the model's 8 experts"),
        (4, ["--parallelism.expert_parallel_degree", "4", "--parallelism.tensor_parallel_degree", "2"],
         "expert_parallel_degree: 4 must divide data_parallel_shard_degree x "
         "context_parallel_degree = 2 x 1 = 2"),
        (4, ["--parallelism.expert_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
             "--parallelism.expert_tensor_parallel_degree", "1"],
         "expert_tensor_parallel_degree: 1 is not supported with tensor_parallel_degree 2"),
    ],
)  # fmt: skip
def test_layouts_that_cannot_split_the_experts_are_named(world, args, words):
    with pytest.raises(ConfigError) as e:
        plan_job(parse_args([*L4, *args]), world_size=world)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_needs_experts():
    with pytest.raises(ConfigError, match="2, but this model has no experts; use 1"):
        plan_job(parse_args(["--parallelism.expert_parallel_degree", "2"]), world_size=2)


def test_expert_parallel_borrows_data_and_context_parallel_ranks():
    cfg = parse_args([*L4, "--parallelism.expert_parallel_degree", "4",
                      "--parallelism.context_parallel_degree", "2"])  # fmt: skip
    dims = plan_job(cfg, world_size=8).dims
    assert (dims.dp_shard, dims.cp, dims.ep, dims.etp) == (4, 2, 4, 1)
    assert dims.dp == 4  # EP reads no batches of its own
    assert "ep=4" in dims.layout()
