"""The fast trace of the memory estimate (torchtitan/train/memory_estimate.py) against the
full trace: the debug model's 6 layers traced at 3 and 4 and extrapolated give the peak of all
6 traced, and a MoE stack's too; a pipeline is traced whole, each rank in a process of its own."""

from __future__ import annotations

import pytest

from torchtitan.train.memory_estimate import estimate_memory

DEBUG = ["--job.config_file", "train_configs/debug_model.toml", "--training.seq_len", "512"]


@pytest.mark.parametrize(
    "layout",
    [
        ["--training.local_batch_size", "4"],
        ["--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"],
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
    ],
)
def test_the_fast_trace_gives_the_full_traces_peak(layout):
    """The debug model's 6 layers traced at 3 and 4 and extrapolated, against all 6 traced."""
    fast = estimate_memory([*DEBUG, *layout], 4, "cpu", fast=True)
    full = estimate_memory([*DEBUG, *layout], 4, "cpu", fast=False)
    assert "traced with 3 and 4 layers" in fast["notes"][-1]
    assert fast["peak_gib"] == pytest.approx(full["peak_gib"], rel=0.01)
    for row, value in full["breakdown_gib"].items():
        assert fast["breakdown_gib"][row] == pytest.approx(value, rel=0.02, abs=1e-3), row


def test_a_pipeline_is_traced_whole():
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "4"]
    e = estimate_memory([*DEBUG, *pp], 4, "cpu", fast=True)
    assert not any("extrapolated" in n for n in e["notes"])
    assert e["per_pp_rank"] and len(e["per_pp_rank"]) == 2


def test_a_pipeline_stage_accumulates_its_unsharded_gradients_in_float32():
    """As torch's pipeline schedules run FSDP: no reduce-scatter before the last micro-batch's
    backward, so each stage holds its whole (unsharded) gradients, in float32 when the compute
    is bfloat16: dp_shard (2) times the float32 gradient shard the formula counts."""
    pp = ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2"]
    args = [*DEBUG, *pp, "--training.seq_len", "64", "--activation_checkpoint.mode", "full"]
    e = estimate_memory(args, 4, "cuda", fast=True)
    for rank in e["per_pp_rank"]:
        shard = rank["formula_gib"]["gradients"]
        assert rank["breakdown_gib"]["gradients"] == pytest.approx(2 * shard, rel=0.01), rank
    # the planner's floor for the layout counts them too, with the activations the last stage
    # holds again after its first backward (2 micro-batches, 1F1B), and stays below the traced
    # peak
    from torchtitan.config.parse import parse_args
    from torchtitan.devices import device_by_key
    from torchtitan.planning.cost import gpu_hardware
    from torchtitan.planning.layouts import config_layout
    from torchtitan.planning.planner import _facts, _Walk

    cfg = parse_args(args, need_files=False)
    walk = _Walk(cfg, 4, gpu_hardware(device_by_key("h100")), "cuda", _facts(cfg), 4)
    lay = config_layout(cfg, 4)
    floor, (params, _) = walk._floor_gib(lay), walk._sizes(lay)
    whole = min(r["breakdown_gib"]["gradients"] for r in e["per_pp_rank"])
    gathered, grads = walk._pipelined_fsdp_bytes(lay, params)
    assert grads / 1024**3 == pytest.approx(whole, rel=0.05)
    state = (walk.fixed_bytes * params + gathered + grads) / 1024**3
    assert state < floor <= e["peak_gib"], (floor, state, e["peak_gib"])


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_the_planners_floor_stays_under_the_traced_peak_after_learning_from_it(schedule):
    """The floor of a pipelined layout, before and after the planner learns the per-token
    memory from that layout's own trace, is at most the traced peak (the trace holds each
    local stage's most micro-batches; the floor what the stages hold together)."""
    from torchtitan.config.parse import parse_args
    from torchtitan.devices import device_by_key
    from torchtitan.planning.cost import gpu_hardware
    from torchtitan.planning.layouts import config_layout
    from torchtitan.planning.planner import _facts, _Walk

    args = [*DEBUG, "--parallelism.pipeline_parallel_degree", "2"]
    args += ["--parallelism.pipeline_parallel_schedule", schedule]
    args += ["--training.local_batch_size", "8", "--activation_checkpoint.mode", "none"]
    peak = estimate_memory(args, 4, "cuda", fast=True)["peak_gib"]
    cfg = parse_args(args, need_files=False)
    walk = _Walk(cfg, 4, gpu_hardware(device_by_key("h100")), "cuda", _facts(cfg), 16)
    lay = config_layout(cfg, 4)
    assert lay.microbatches == 8 and walk._floor_gib(lay) <= peak
    walk._learn(lay, peak)
    assert walk.learned["none"] > 0
    # below it (LEARNED_SHARE < 1): learning per micro-batch held through a stage, not per the
    # min(micro-batches, pp) of 1F1B's warm-up, which put Interleaved1F1B's floor at the peak
    assert walk._floor_gib(lay) < peak, (walk._floor_gib(lay), peak)


def test_the_fast_trace_of_a_moe_stack_with_a_dense_first_layer():
    """DeepSeek-V3's debug flavor at 8 layers (the first dense, the rest MoE with expert
    parallel 2): traced at 4 and 5 layers and extrapolated, against all 8 traced."""
    args = ["--job.config_file", "train_configs/deepseek_v3_debug.toml", "--model.n_layers", "8"]
    args += ["--training.seq_len", "256", "--parallelism.expert_parallel_degree", "2"]
    fast = estimate_memory(args, 4, "cpu", fast=True)
    full = estimate_memory(args, 4, "cpu", fast=False)
    assert any("traced with 4 and 5 layers" in n for n in fast["notes"]), fast["notes"]
    assert fast["peak_gib"] == pytest.approx(full["peak_gib"], rel=0.01)
