"""DeepSeekMoE routing on the shared MoE layer against ``transformers``' DeepSeek-V3 MoE on the
same weights: sigmoid scores, the correction bias choosing, group-limited top-k, renormalized
and scaled weights, a shared expert."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from torchtitan.models.common.moe import MoE, MoEArgs

DIM, HIDDEN, EXPERTS = 16, 8, 8


def _pair(n_group: int, topk_group: int, norm: bool, top_k: int = 3) -> tuple[torch.nn.Module, MoE]:
    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=DIM,
        moe_intermediate_size=HIDDEN,
        n_routed_experts=EXPERTS,
        n_shared_experts=2,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.5,
    )
    theirs = hf.DeepseekV3MoE(config).eval()
    for p in theirs.parameters():
        torch.nn.init.normal_(p, std=0.3)
    # a bias large enough to change choices: the published checkpoints' is far from zero
    theirs.gate.e_score_correction_bias.normal_(std=0.2)
    args = MoEArgs(
        num_experts=EXPERTS,
        top_k=top_k,
        hidden_dim=HIDDEN,
        score_func="sigmoid",
        route_norm=norm,
        route_scale=2.5,
        shared_hidden_dim=2 * HIDDEN,
        num_groups=n_group,
        topk_groups=topk_group,
        load_balance_coeff=1e-3,  # the bias takes part in the choice
    )
    ours = MoE(DIM, args)
    gate_up = theirs.experts.gate_up_proj.detach()
    shared = theirs.shared_experts
    ours.load_state_dict(
        {
            "router.gate.weight": theirs.gate.weight.detach(),
            "expert_bias": theirs.gate.e_score_correction_bias.detach(),
            "experts.w1": gate_up[:, :HIDDEN],
            "experts.w3": gate_up[:, HIDDEN:],
            "experts.w2": theirs.experts.down_proj.detach(),
            "shared_experts.w1.weight": shared.gate_proj.weight.detach(),
            "shared_experts.w3.weight": shared.up_proj.weight.detach(),
            "shared_experts.w2.weight": shared.down_proj.weight.detach(),
        }
    )
    return theirs, ours


@pytest.mark.parametrize(
    "n_group, topk_group, norm",
    [(1, 1, True), (4, 2, True), (4, 2, False), (2, 1, True)],
    ids=["one_group", "2_of_4_groups", "2_of_4_unnormalized", "1_of_2_groups"],
)
def test_routing_and_output_match_transformers_deepseek_v3_moe(n_group, topk_group, norm):
    theirs, ours = _pair(n_group, topk_group, norm)
    x = torch.randn(2, 10, DIM)
    _, their_weights, their_experts = theirs.gate(x)
    our_weights, our_experts, _ = ours.router(x.reshape(-1, DIM), ours.expert_bias)
    # the same experts (in any order) with the same weights
    order_t, order_o = their_experts.argsort(-1), our_experts.argsort(-1)
    assert torch.equal(their_experts.gather(-1, order_t), our_experts.gather(-1, order_o))
    torch.testing.assert_close(
        our_weights.gather(-1, order_o), their_weights.gather(-1, order_t), rtol=1e-6, atol=1e-7
    )
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


def test_groups_change_the_choice():
    """With one group of the four allowed, every token's experts lie in one group of two."""
    _, ours = _pair(4, 1, True, top_k=2)
    _, experts, _ = ours.router(torch.randn(40, DIM), ours.expert_bias)
    groups = experts // 2
    assert (groups[:, 0] == groups[:, 1]).all()
    ungrouped = MoEArgs(**{**vars(ours.args), "num_groups": 1, "topk_groups": 1})
    ours.router.args = ungrouped
    _, free, _ = ours.router(torch.randn(200, DIM), ours.expert_bias)
    assert (free[:, 0] // 2 != free[:, 1] // 2).any()  # without groups they do cross
