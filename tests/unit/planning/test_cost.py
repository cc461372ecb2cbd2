"""The cost model (torchtitan/planning/cost.py): each term is its count over its rate, exposed
where the code does not overlap it; checked on a hand-sized model against the formulas."""

from __future__ import annotations

import dataclasses

import pytest

from torchtitan.devices import device_by_key
from torchtitan.planning.cost import (
    LOSS_BYTES,
    NORM_ROPE_ADD,
    SWIGLU,
    Hardware,
    Layout,
    ModelFacts,
    gpu_hardware,
    mfu,
    step_cost,
    tokens_per_second_per_device,
)

SEQ = 1024
# a model of round numbers: 8 blocks of 1e8 parameters, 2e7 outside them
FACTS = ModelFacts(
    name="round",
    parameters=int(8e8 + 2e7),
    flops_per_token=6 * 8e8 + 6 * 1e7 + 8 * 6 * SEQ * 1024,
    attention_flops_per_token=8 * 6 * SEQ * 1024,
    n_layers=8,
    dim=1024,
    hidden_dim=4096,
    vocab_size=10_000,
    kv_width=256,
    layer_parameters=int(8e8),
    outer_parameters=int(2e7),
    output_flops_per_token=6 * 1e7,
)
HW = Hardware(
    name="test",
    peak_flops=1e15,
    matmul_efficiency=0.5,
    attention_efficiency=0.25,
    hbm_bytes_s=2e12,
    link_bytes_s=4e11,
    network_bytes_s=5e10,
    devices_per_node=8,
    latency_s=0.0,
    memory_gib=80.0,
    source="test",
)


def _per_token_seconds(recompute: float = 0.0) -> float:
    block = (FACTS.flops_per_token - FACTS.attention_flops_per_token - 6e7) / 8
    attention = FACTS.attention_flops_per_token / 8
    flops = 8 * (1 + recompute) * (block / 0.5 + attention / 0.25) + 6e7 / 0.5
    traffic = 8 * (1 + recompute) * (NORM_ROPE_ADD * 1024 + SWIGLU * 4096) * 2
    return flops / 1e15 + (traffic + 10_000 * LOSS_BYTES) / 2e12


def test_one_device_is_compute_and_the_optimizer_step():
    lay = Layout(1, 1, 1, 1, 1, local_batch=4)
    cost = step_cost(FACTS, lay, HW, SEQ)
    assert set(cost.terms) == {"compute", "optimizer"}
    assert cost.terms["compute"] == pytest.approx(4 * SEQ * _per_token_seconds())
    assert cost.terms["optimizer"] == pytest.approx(28 * 8.2e8 / 2e12)
    assert cost.seconds == pytest.approx(sum(cost.terms.values()))
    tps = tokens_per_second_per_device(FACTS, lay, cost, SEQ)
    assert tps == pytest.approx(4 * SEQ / cost.seconds)
    assert mfu(FACTS, lay, cost, HW, SEQ) == pytest.approx(FACTS.flops_per_token * tps / 1e15)


@pytest.mark.parametrize(
    "ac, recompute", [("full", 1 / 3), ("selective", 1 / 6), ("selective:2", 1 / 6)]
)
def test_checkpointing_recomputes_the_blocks_forward(ac, recompute):
    cost = step_cost(FACTS, Layout(1, 1, 1, 1, 1, ac=ac, local_batch=4), HW, SEQ)
    assert cost.terms["compute"] == pytest.approx(4 * SEQ * _per_token_seconds(recompute))


def test_fsdp_is_hidden_behind_compute_but_one_block_and_shows_over_a_slow_network():
    inside = step_cost(FACTS, Layout(1, 8, 1, 1, 1, local_batch=4), HW, SEQ)
    volume = (2 * 2 + 4) * 8.2e8 * 7 / 8  # gather twice in bf16, reduce-scatter in float32
    assert volume / 4e11 < inside.terms["compute"]
    assert inside.terms["fsdp"] == pytest.approx(volume / 4e11 / 8)  # one block's worth
    # 16 ranks: two nodes, the network's 50 GB/s
    across = step_cost(FACTS, Layout(1, 16, 1, 1, 1, local_batch=1), HW, SEQ)
    volume16 = (2 * 2 + 4) * 8.2e8 * 15 / 16
    assert across.terms["fsdp"] == pytest.approx(volume16 / 5e10 - across.terms["compute"])
    assert across.limit == "fsdp"


def test_tensor_parallel_moves_the_activations_eight_times_a_block_unhidden():
    one = step_cost(FACTS, Layout(1, 1, 1, 1, 1, local_batch=4), HW, SEQ)
    tp = step_cost(FACTS, Layout(1, 1, 1, 4, 1, local_batch=4), HW, SEQ)
    assert tp.terms["compute"] == pytest.approx(one.terms["compute"] / 4)
    act = 4 * SEQ * 1024 * 2 * 3 / 4
    assert tp.terms["tp"] == pytest.approx(8 * 8 * act / 4e11)
    full = step_cost(FACTS, Layout(1, 1, 1, 4, 1, ac="full", local_batch=4), HW, SEQ)
    assert full.terms["tp"] == pytest.approx(8 * 12 * act / 4e11)  # the recomputed forward's


@pytest.mark.parametrize(
    "schedule, bubble", [("1F1B", 3 / 4), ("Interleaved1F1B", 3 / 8), ("ZBVZeroBubble", 1 / 8)]
)
def test_the_pipeline_bubble_per_schedule(schedule, bubble):
    lay = Layout(1, 1, 1, 1, 4, local_batch=4, schedule=schedule, microbatch=1)
    cost = step_cost(FACTS, lay, HW, SEQ)
    assert cost.terms["pp_bubble"] == pytest.approx(bubble * cost.terms["compute"])
    # a stage computes its quarter of the blocks, and the output
    assert (
        cost.terms["compute"]
        < step_cost(FACTS, Layout(1, 1, 1, 1, 1, local_batch=4), HW, SEQ).terms["compute"] / 2
    )


def test_more_microbatches_shrink_the_bubble():
    few = Layout(1, 1, 1, 1, 4, local_batch=4, schedule="1F1B", microbatch=1)
    many = dataclasses.replace(few, local_batch=16)
    frac = [
        step_cost(FACTS, lay, HW, SEQ).terms["pp_bubble"]
        / step_cost(FACTS, lay, HW, SEQ).terms["compute"]
        for lay in (few, many)
    ]
    assert frac == pytest.approx([3 / 4, 3 / 16])


def test_context_parallel_is_hidden_by_attention_until_the_ring_is_slower():
    hidden = step_cost(FACTS, Layout(1, 1, 2, 1, 1, local_batch=4), HW, SEQ)
    assert hidden.terms["cp"] == 0.0
    slow = dataclasses.replace(HW, link_bytes_s=1e8)
    exposed = step_cost(FACTS, Layout(1, 1, 2, 1, 1, local_batch=4), slow, SEQ)
    assert exposed.terms["cp"] > 0


def test_on_shared_cores_nothing_is_hidden_and_the_bubble_is_free():
    """CPU processes: the cores that compute also copy the collectives' bytes, and a rank
    waiting in the bubble lends its core to another (planning/calibrate.py)."""
    cpu = dataclasses.replace(HW, overlap=False, idle_lends_cores=True)
    fsdp = step_cost(FACTS, Layout(1, 8, 1, 1, 1, local_batch=4), cpu, SEQ)
    assert fsdp.terms["fsdp"] == pytest.approx((2 * 2 + 4) * 8.2e8 * 7 / 8 / 4e11)
    pp = Layout(1, 1, 1, 1, 4, local_batch=4, schedule="1F1B", microbatch=1)
    assert step_cost(FACTS, pp, cpu, SEQ).terms["pp_bubble"] == 0.0


def test_replicas_all_reduce_the_gradients_after_every_backward():
    """No sync is skipped while accumulating: four local batches, four all-reduces."""
    slow = dataclasses.replace(HW, network_bytes_s=1e9)  # 2 x 8 ranks: the network
    one = step_cost(FACTS, Layout(2, 8, 1, 1, 1, local_batch=1), slow, SEQ)
    accum = step_cost(FACTS, Layout(2, 8, 1, 1, 1, local_batch=1, accum=4), slow, SEQ)
    grads = 4 * 8.2e8 / 8  # float32, this rank's FSDP shard
    ar = 2 * grads / 2 / 1e9
    assert one.terms["replicate"] == pytest.approx(ar - one.terms["compute"] * 2 / 3)
    assert accum.terms["replicate"] == pytest.approx(4 * one.terms["replicate"])
    assert accum.terms["compute"] == pytest.approx(4 * one.terms["compute"])


def test_expert_parallel_all_to_all_and_fewer_experts_to_gather():
    # half of each block's parameters are routed experts
    moe = dataclasses.replace(FACTS, moe_layers=8, top_k=2, expert_parameters=int(4e8))
    cpu = dataclasses.replace(HW, overlap=False)  # the whole FSDP volume, to compare
    fsdp = step_cost(moe, Layout(1, 4, 1, 1, 1, local_batch=2), cpu, SEQ)
    ep = step_cost(moe, Layout(1, 4, 1, 1, 1, ep=4, local_batch=2), cpu, SEQ)
    a2a = 4 * 2 * SEQ * 2 * 1024 * 2 * 3 / 4
    assert ep.terms["ep"] == pytest.approx(8 * a2a / 4e11)
    dense = 4e8 + 2e7
    assert fsdp.terms["fsdp"] == pytest.approx(8 * (dense + 4e8) * 3 / 4 / 4e11)
    # with ep 4 a rank holds a quarter of the experts whole: FSDP gathers the rest only
    assert ep.terms["fsdp"] == pytest.approx(8 * dense * 3 / 4 / 4e11)
    # each rank still holds the same share: a quarter of the experts whole, or a quarter of each
    assert ep.terms["optimizer"] == pytest.approx(fsdp.terms["optimizer"])


def test_whole_experts_under_tp_gather_whole_experts_and_send_a_share_of_the_rows():
    """EP 4 borrowing the 4 TP ranks (etp 1): a rank holds a quarter of the experts whole,
    FSDP over the 2 dp_shard ranks gathers them whole, and each TP rank sends a quarter of the
    routed rows; with the experts split over TP (etp 4), EP needs 4 dp_shard ranks."""
    moe = dataclasses.replace(FACTS, moe_layers=8, top_k=2, expert_parameters=int(4e8))
    cpu = dataclasses.replace(HW, overlap=False)
    whole = Layout(1, 2, 1, 4, 1, ep=4, etp=1, local_batch=2)
    assert whole.experts_whole and "whole experts" in whole.describe()
    cost = step_cost(moe, whole, cpu, SEQ)
    dense = (4e8 + 2e7) / 4  # TP splits them
    experts = 4e8 / 4  # a quarter of the experts, whole; efsdp = 2 x 4 / 4 = 2
    assert cost.terms["fsdp"] == pytest.approx(8 * (dense + experts) / 2 / 4e11)
    a2a = 4 * 2 * SEQ / 4 * 2 * 1024 * 2 * 3 / 4
    assert cost.terms["ep"] == pytest.approx(8 * a2a / 4e11)
    split = step_cost(moe, Layout(1, 4, 1, 4, 1, ep=4, etp=4, local_batch=2), cpu, SEQ)
    # split: every TP rank sends all its rows, to EP ranks 4 apart (16 ranks: the network)
    assert split.terms["ep"] == pytest.approx(8 * 4 * a2a / 5e10)
    # the same share of the parameters on every rank either way
    same = step_cost(moe, Layout(1, 2, 1, 4, 1, local_batch=2), cpu, SEQ)
    assert cost.terms["optimizer"] == pytest.approx(same.terms["optimizer"])


def test_a_gpu_takes_its_measured_matmul_efficiency():
    h100 = gpu_hardware(device_by_key("h100"))
    assert h100.matmul_efficiency == pytest.approx(782 / 989)
    assert "measured" in h100.source
    b200 = gpu_hardware(device_by_key("b200"))
    assert "assumed" in b200.source
    assert gpu_hardware(device_by_key("h100"), network_gb_s=25).network_bytes_s == 25e9
