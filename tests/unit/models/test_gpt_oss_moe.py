"""gpt-oss's mixture of experts on the shared MoE layer (``torchtitan/models/common/moe.py``:
a biased router, softmax over the top-k logits, experts with biases and the clamped SwiGLU with
its ``+1``) against ``transformers``' ``GptOssMLP``, with weights large enough that the clamp
at +-7 bites; the grouped-mm kernel against the per-expert loop in values and gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchtitan.models.common.moe import MoE, MoEArgs
from torchtitan.models.gpt_oss.model import gpt_oss_moe

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

DIM, HIDDEN, EXPERTS, TOP_K = 16, 12, 8, 4


def _moe(grouped_mm: bool = True) -> MoE:
    torch.manual_seed(0)
    with torch.device("meta"):
        args = dataclasses.replace(gpt_oss_moe(EXPERTS, TOP_K, HIDDEN), grouped_mm=grouped_mm)
        moe = MoE(DIM, args)
    moe.to_empty(device="cpu")
    moe.init_weights(0.02)
    with torch.no_grad():  # weights and biases far from zero: ties are rare, the clamp bites
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def _theirs(moe: MoE):
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )  # fmt: skip
    mlp = modeling.GptOssMLP(config)
    e = moe.experts
    with torch.no_grad():
        mlp.router.weight.copy_(moe.router.gate.weight)
        mlp.router.bias.copy_(moe.router.gate.bias)
        # transformers' experts are [E, in, out], gate and up interleaved along out
        mlp.experts.gate_up_proj.copy_(torch.stack((e.w1, e.w3), 2).flatten(1, 2).transpose(1, 2))
        mlp.experts.gate_up_proj_bias.copy_(torch.stack((e.w1_bias, e.w3_bias), -1).flatten(-2))
        mlp.experts.down_proj.copy_(e.w2.transpose(1, 2))
        mlp.experts.down_proj_bias.copy_(e.w2_bias)
    return mlp


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["grouped_mm", "loop"])
def test_equals_transformers_gpt_oss_mlp(grouped_mm):
    moe = _moe(grouped_mm)
    theirs = _theirs(moe)
    x = torch.randn(3, 10, DIM, generator=torch.Generator().manual_seed(1)) * 3
    out = theirs(x)
    want = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)
    # the clamp bites: some gate values pass 7 and some up values leave [-7, 7]
    flat = x.reshape(-1, DIM)
    gate = torch.einsum("nd,ehd->neh", flat, moe.experts.w1) + moe.experts.w1_bias
    up = torch.einsum("nd,ehd->neh", flat, moe.experts.w3) + moe.experts.w3_bias
    assert (gate > 7).any() and (up.abs() > 7).any()


def test_grouped_mm_equals_the_loop_in_values_and_gradients():
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(2)) * 3
    results = []
    for grouped in (True, False):
        moe = _moe(grouped)
        out = moe(x)
        out.backward(torch.ones_like(out))
        results.append([out] + [p.grad for p in moe.parameters()])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in results[0][1:])  # every bias is trained


def test_a_bad_activation_is_named():
    with pytest.raises(ValueError, match="activation 'gelu' is not one of: silu, clamped_swiglu"):
        MoEArgs(activation="gelu")
