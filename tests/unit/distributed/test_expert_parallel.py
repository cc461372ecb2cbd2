"""Expert parallelism without processes: the regrouping of the rows an all-to-all delivers, and
the one-line errors of layouts that cannot split the experts. (The numbers of real EP runs
against one process are in tests/e2e/test_moe_parallel.py.)"""

from __future__ import annotations

import pytest
import torch

from torchtitan.config.parse import parse_args
from torchtitan.distributed.expert_parallel import regroup_index
from torchtitan.errors import ConfigError
from torchtitan.train.plan import plan_job

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
        (
            3,
            ["--parallelism.expert_parallel_degree", "3"],
            "expert_parallel_degree: 3 does not divide the model's 8 experts",
        ),
        (
            4,
            [
                "--parallelism.expert_parallel_degree",
                "4",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.expert_tensor_parallel_degree",
                "2",
            ],
            "expert_parallel_degree: 4 must divide data_parallel_shard_degree x "
            "context_parallel_degree = 2 x 1 = 2",
        ),
        (
            8,
            [
                "--parallelism.expert_parallel_degree",
                "8",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_shard_degree",
                "2",
                "--parallelism.data_parallel_replicate_degree",
                "2",
            ],
            "expert_parallel_degree: 8 must divide data_parallel_shard_degree x "
            "context_parallel_degree x tensor_parallel_degree = 2 x 1 x 2 = 4",
        ),
        (
            4,
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "4",
            ],
            "expert_parallel_degree: 2 leaves the experts replicated over 2 tensor parallel ranks "
            "without FSDP",
        ),
        (
            4,
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.data_parallel_replicate_degree",
                "2",
            ],
            "with data_parallel_replicate_degree 2 needs FSDP for the experts",
        ),
        (
            4,
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.expert_tensor_parallel_degree",
                "4",
            ],
            "expert_tensor_parallel_degree: 4 is not supported with tensor_parallel_degree 2; use 1",
        ),
        (
            2,
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.expert_tensor_parallel_degree",
                "2",
            ],
            "expert_tensor_parallel_degree: 2 needs tensor parallel; use 1 (or -1)",
        ),
    ],
)
def test_layouts_that_cannot_split_the_experts_are_named(world, args, words):
    with pytest.raises(ConfigError) as e:
        plan_job(parse_args([*L4, *args]), world_size=world)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_expert_parallel_needs_experts():
    with pytest.raises(ConfigError, match="2, but this model has no experts; use 1"):
        plan_job(parse_args(["--parallelism.expert_parallel_degree", "2"]), world_size=2)


def test_expert_parallel_borrows_data_and_context_parallel_ranks():
    cfg = parse_args(
        [
            *L4,
            "--parallelism.expert_parallel_degree",
            "4",
            "--parallelism.context_parallel_degree",
            "2",
        ]
    )
    dims = plan_job(cfg, world_size=8).dims
    assert (dims.dp_shard, dims.cp, dims.ep, dims.etp) == (4, 2, 4, 1)
    assert dims.dp == 4  # EP reads no batches of its own
    assert "ep=4" in dims.layout()


@pytest.mark.parametrize(
    "ep, args, etp",
    [
        (2, [], 1),  # upstream's default: whole experts, EP borrowing the TP ranks too
        (4, [], 1),  # 4 = dp_shard x tp: every rank holds its own 2 of the 8 experts
        (2, ["--parallelism.expert_tensor_parallel_degree", "2"], 2),  # split like the dense
        (2, ["--parallelism.expert_tensor_parallel_degree", "-1"], 2),  # -1 says the same
    ],
)
def test_expert_tensor_parallel_degree_picks_the_ranks_expert_parallel_borrows(ep, args, etp):
    cfg = parse_args(
        [
            *L4,
            "--parallelism.expert_parallel_degree",
            str(ep),
            "--parallelism.tensor_parallel_degree",
            "2",
            *args,
        ]
    )
    dims = plan_job(cfg, world_size=4).dims
    assert (dims.dp_shard, dims.tp, dims.ep, dims.etp) == (2, 2, ep, etp)
    assert dims.experts_whole_under_tp == (etp == 1)
    assert dims.layout().endswith(f"ep={ep}" + (" etp=1" if etp == 1 else ""))


def test_expert_tensor_parallel_degree_has_no_effect_without_expert_parallel():
    """As upstream: with EP 1 the experts are split like the dense layers whatever it says."""
    for etp in ("1", "3"):  # any value
        cfg = parse_args(
            [
                *L4,
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.expert_tensor_parallel_degree",
                etp,
            ]
        )
        dims = plan_job(cfg, world_size=2).dims
        assert (dims.ep, dims.etp, dims.experts_whole_under_tp) == (1, 2, False)


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 7], [1], [4, 4]])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_each_tp_rank_counts_its_share_of_the_routed_rows(counts, tp):
    """Whole experts under TP: rank r runs its contiguous share of the rows (sorted by expert);
    the counts it passes on are its share's rows per expert, and the shares cover every row."""
    from torchtitan.distributed.tensor_parallel import row_share, split_counts

    counts_t = torch.tensor(counts)
    expert_of_row = torch.arange(len(counts)).repeat_interleave(counts_t)
    total = int(counts_t.sum())
    shares = [row_share(total, r, tp) for r in range(tp)]
    assert shares[0][0] == 0 and shares[-1][1] == total  # contiguous, in rank order, even
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))
    assert max(hi - lo for lo, hi in shares) - min(hi - lo for lo, hi in shares) <= 1
    summed = torch.zeros_like(counts_t)
    for lo, hi in shares:
        want = torch.bincount(expert_of_row[lo:hi], minlength=len(counts))
        got = split_counts(counts_t, lo, hi)
        assert got.tolist() == want.tolist()
        summed += got
    assert summed.tolist() == counts
