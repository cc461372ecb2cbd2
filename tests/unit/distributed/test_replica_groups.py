"""Replica groups (torchtitan/distributed/replica_groups.py) without processes: the config's
one-line refusals, what a group needs before it starts, the share of the batch each group reads,
and the state a healing group is sent (local tensors) put back in place. Groups training, dying
and healing are in tests/e2e/test_replica_groups.py."""

from __future__ import annotations

import pytest
import torch

from torchtitan.config.parse import parse_args
from torchtitan.distributed.replica_groups import (
    check_environment,
    into_place,
    local_state,
    quorum_timeout_ms,
)
from torchtitan.errors import ConfigError

FT = ["--fault_tolerance.enable"]


@pytest.mark.parametrize(
    "args, message",
    [
        ([], r"fault_tolerance.group_size.*how many replica groups train together must be set"),
        (
            ["--fault_tolerance.group_size=2", "--fault_tolerance.replica_id=2"],
            "fault_tolerance.replica_id: 2 is not a group of group_size 2; valid: 0 .. 1",
        ),
        (
            ["--fault_tolerance.group_size=2", "--fault_tolerance.min_replica_size=3"],
            "fault_tolerance.min_replica_size: 3 groups can never meet",
        ),
        (
            ["--fault_tolerance.group_size=2", "--parallelism.data_parallel_replicate_degree=2"],
            "parallelism.data_parallel_replicate_degree: the replica groups are the replicate",
        ),
        (
            ["--fault_tolerance.group_size=2", "--optimizer.early_step_in_backward"],
            "optimizer.early_step_in_backward: updates each parameter in the backward",
        ),
        (
            ["--fault_tolerance.group_size=2", "--resilience.loss_spike_zscore=4"],
            "resilience.loss_spike_zscore: each replica group would judge its own loss",
        ),
    ],
)
def test_replica_group_settings_are_checked(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args([*FT, *args])


SEMI = [*FT, "--fault_tolerance.group_size=2"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--fault_tolerance.semi_sync_method=diloco"],
            "fault_tolerance.semi_sync_method: diloco is how replica groups train together; "
            "set fault_tolerance.enable",
        ),
        (
            [*SEMI, "--fault_tolerance.semi_sync_method=DiLoCo2"],
            "fault_tolerance.semi_sync_method: 'DiLoCo2' is not one of: diloco, local_sgd",
        ),
        (
            [*SEMI, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.sync_steps=0"],
            "fault_tolerance.sync_steps: 0 must be >= 1",
        ),
        (
            [*SEMI, "--fault_tolerance.semi_sync_method=diloco", "--fault_tolerance.outer_lr=0"],
            "fault_tolerance.outer_lr: 0.0 must be > 0",
        ),
        (
            [*SEMI, "--fault_tolerance.fragment_update_alpha=1.5"],
            "fault_tolerance.fragment_update_alpha: 1.5 must be <= 1",
        ),
        (
            [*SEMI, "--fault_tolerance.fragment_sync_delay=2"],
            "fault_tolerance.fragment_sync_delay.*not overlapped with inner steps here; use 0",
        ),
    ],
)
def test_semi_synchronous_settings_are_checked(args, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(args)


def test_semi_synchronous_groups_may_step_in_backward_and_guard_spikes():
    """Inner steps are each group's own: what would part every-step groups is allowed."""
    cfg = parse_args(
        [
            *SEMI,
            "--fault_tolerance.semi_sync_method=local_sgd",
            "--optimizer.early_step_in_backward",
            "--resilience.loss_spike_zscore=4",
        ]
    )
    assert cfg.fault_tolerance.semi_sync_method == "local_sgd"


def test_upstream_diloco_section_is_read(tmp_path):
    """An upstream [fault_tolerance] section for DiLoCo, as written there."""
    toml = tmp_path / "ft.toml"
    toml.write_text(
        "[fault_tolerance]\nenable = true\ngroup_size = 2\nreplica_id = 1\n"
        'semi_sync_method = "diloco"\nsync_steps = 20\nshould_quantize = false\n'
        "fragment_sync_delay = 0\nfragment_update_alpha = 0.0\n"
    )
    ft = parse_args(["--job.config_file", str(toml)]).fault_tolerance
    assert (ft.semi_sync_method, ft.sync_steps, ft.outer_lr, ft.outer_momentum) == (
        "diloco",
        20,
        0.7,
        0.9,
    )


def test_a_group_needs_the_lighthouse_address(monkeypatch):
    pytest.importorskip("torchft")
    cfg = parse_args([*FT, "--fault_tolerance.group_size=2"])
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ConfigError, match="TORCHFT_LIGHTHOUSE is not set; start a lighthouse"):
        check_environment(cfg.fault_tolerance)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    check_environment(cfg.fault_tolerance)


def test_nccl_between_groups_needs_cuda(monkeypatch):
    pytest.importorskip("torchft")
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    cfg = parse_args(
        [*FT, "--fault_tolerance.group_size=2", "--fault_tolerance.process_group=nccl"]
    )
    with pytest.raises(ConfigError, match="fault_tolerance.process_group: nccl needs CUDA"):
        check_environment(cfg.fault_tolerance, "cpu")


def test_each_group_reads_its_part_of_the_global_batch(monkeypatch):
    """Group g of G, data-parallel rank r of d: reader g*d + r of G*d, and the global batch is
    every group's (local 2 x dp 1 x 2 groups = 4 without accumulation)."""
    pytest.importorskip("torchft")
    from torchtitan.train.plan import plan_job

    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://localhost:29510")
    args = ["--training.local_batch_size=2", "--training.global_batch_size=4"]
    for replica in (0, 1):
        cfg = parse_args(
            [
                *FT,
                "--fault_tolerance.group_size=2",
                f"--fault_tolerance.replica_id={replica}",
                *args,
            ]
        )
        plan = plan_job(cfg, world_size=1)
        assert plan.data_shard() == (replica, 2)
        assert (plan.global_batch_size, plan.grad_accum_steps) == (4, 1)


def test_state_sent_to_a_healing_group_is_put_back_in_its_form():
    current = {
        "w": torch.zeros(2, 3),
        "nested": {"b": torch.zeros(3, dtype=torch.bfloat16)},
        "step": 4,
    }
    sent = local_state({"w": torch.ones(2, 3), "nested": {"b": torch.ones(3)}, "step": 9})
    placed = into_place(current, sent)
    assert torch.equal(placed["w"], torch.ones(2, 3)) and placed["step"] == 9
    assert placed["nested"]["b"].dtype == torch.bfloat16  # the receiver's dtype and device


def test_semi_synchronous_groups_wait_longer_for_their_quorum():
    """Groups in step meet every step; semi-synchronous ones wait at a sync for the others'
    inner steps (a restarted one for all of them): a longer default, and the key wins."""
    base = [*SEMI]
    assert quorum_timeout_ms(parse_args(base).fault_tolerance) == 60_000
    semi = [*base, "--fault_tolerance.semi_sync_method=diloco"]
    assert quorum_timeout_ms(parse_args(semi).fault_tolerance) == 1_800_000
    given = [*semi, "--fault_tolerance.quorum_timeout_ms=5000"]
    assert quorum_timeout_ms(parse_args(given).fault_tolerance) == 5000
