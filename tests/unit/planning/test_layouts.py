"""The layouts the planner lists (torchtitan/planning/layouts.py): every one fills the world and
keeps the global batch, the command line's layout keys stay as given, and a layout's config
keys say that layout back."""

from __future__ import annotations

import pytest

from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError
from torchtitan.planning.layouts import (
    candidates,
    cli_overrides,
    config_layout,
    fixed_fields,
    overrides,
    with_layout,
)

DEBUG = ["--job.config_file", "train_configs/debug_model.toml"]


def _all(cli: list[str], world: int, global_batch: int, experts: int = 0):
    cfg = parse_args([*DEBUG, *cli], need_files=False)
    return list(candidates(cfg, world, global_batch, fixed_fields(cli), experts))


def test_every_candidate_fills_the_world_and_keeps_the_global_batch():
    lays = _all([], 16, 32)
    assert len(lays) > 100
    for lay in lays:
        assert lay.world == 16
        assert lay.local_batch * lay.accum * lay.dp_replicate * lay.dp_shard == 32
        if lay.pp > 1:
            assert lay.local_batch % lay.microbatch == 0 and lay.microbatches >= lay.pp
        else:
            assert lay.schedule is None
    kinds = {(lay.tp > 1, lay.cp > 1, lay.pp > 1, lay.dp_replicate > 1) for lay in lays}
    assert len(kinds) == 16  # every combination of TP, CP, PP and replication appears
    assert {lay.ac for lay in lays} == {"none", "selective", "full"}


def test_command_line_keys_fix_their_part_of_the_layout():
    cli = ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"]
    lays = _all(cli, 8, 16)
    assert lays and all(lay.tp == 2 and lay.ac == "full" for lay in lays)
    # an old upstream name fixes the same key
    old = _all(["--training.sequence_parallel_degree", "4"], 8, 16)
    assert old and all(lay.tp == 4 for lay in old)
    assert fixed_fields(["--training.batch_size", "2"]) == {"local_batch"}


def test_expert_parallel_degrees_divide_the_experts_and_the_borrowed_ranks():
    lays = _all([], 8, 16, experts=4)
    eps = {lay.ep for lay in lays}
    assert eps == {1, 2, 4}
    # experts split over TP: EP borrows dp_shard x cp; whole experts (etp 1): x tp too
    split = [lay for lay in lays if lay.tp > 1 and lay.ep > 1 and not lay.experts_whole]
    whole = [lay for lay in lays if lay.experts_whole]
    assert split and whole
    assert all(lay.dp_shard * lay.cp % lay.ep == 0 and lay.etp == lay.tp for lay in split)
    assert all(lay.dp_shard * lay.cp * lay.tp % lay.ep == 0 for lay in lays)
    # EP over the TP ranks alone, which only whole experts can do
    assert any(lay.ep == lay.tp == 4 and lay.dp_shard == 2 for lay in whole)
    # no layout twice: without EP the experts' TP degree says nothing
    assert len(set(lays)) == len(lays)
    assert all(lay.etp == 1 for lay in lays if lay.ep == 1)


def test_an_expert_tensor_parallel_degree_given_keeps_its_kind():
    """Fixed on the command line, 1 means whole experts whatever TP is, -1 experts split over
    whatever TP is, and N experts split over N TP ranks (TP N only)."""
    key = "--parallelism.expert_tensor_parallel_degree"
    whole = _all([key, "1"], 8, 16, experts=4)
    assert whole and all(lay.etp == 1 for lay in whole)
    assert any(lay.experts_whole for lay in whole)
    split = _all([key, "-1"], 8, 16, experts=4)
    assert split and all(lay.etp == lay.tp for lay in split)
    assert {lay.tp for lay in split if lay.ep > 1} == {1, 2, 4}  # TP 8 leaves EP no ranks
    two = _all([key, "2"], 8, 16, experts=4)
    assert two and all(lay.tp == lay.etp == 2 for lay in two)


@pytest.mark.parametrize(
    "cli",
    [
        ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            "--training.local_batch_size",
            "4",
        ],
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "2",
        ],
    ],
)
def test_a_layouts_keys_say_it_back(cli):
    base = parse_args(DEBUG, need_files=False)
    lay = config_layout(parse_args([*DEBUG, *cli], need_files=False), 4)
    cfg = with_layout(base, lay, 16)
    assert config_layout(cfg, 4) == lay
    assert cfg.training.global_batch_size == 16
    again = parse_args([*DEBUG, *cli_overrides(lay, 16)], need_files=False)
    assert config_layout(again, 4) == lay
    assert overrides(lay, 16)["parallelism.data_parallel_shard_degree"] == lay.dp_shard
    assert base.parallelism.tensor_parallel_degree == 1  # the original is not changed


def test_a_schedule_given_is_the_pipelines_schedule():
    """The schedule fixed while the pipeline degree is free: every pipelined layout runs it."""
    lays = _all(["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], 8, 16)
    piped = [lay for lay in lays if lay.pp > 1]
    assert piped and {lay.schedule for lay in piped} == {"Interleaved1F1B"}
    # a given name torch has none of is refused in one line, not planned around (by pp = 1)
    with pytest.raises(ConfigError) as e:
        _all(["--parallelism.pipeline_parallel_schedule", "Interleave1F1B"], 8, 16)
    assert str(e.value) == (
        "parallelism.pipeline_parallel_schedule: unknown schedule 'Interleave1F1B'; valid: GPipe, "
        "1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV"
    )
    # any case is the canonical name
    lays = _all(["--parallelism.pipeline_parallel_schedule", "gpipe"], 8, 16)
    assert {lay.schedule for lay in lays if lay.pp > 1} == {"GPipe"}


def test_selective_checkpointing_as_the_job_says_it():
    assert {lay.ac for lay in _all([], 4, 8)} == {"none", "selective", "full"}  # per-op
    given = _all(["--activation_checkpoint.selective_ac_option", "2"], 4, 8)
    assert {lay.ac for lay in given} == {"none", "selective:2", "full"}
