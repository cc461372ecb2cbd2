"""Multi-head latent attention and YaRN against ``transformers``' DeepSeek-V3 attention on the
same weights (tiny random configs), causal and block-causal."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from torchtitan.models.common.attention import document_mask
from torchtitan.models.common.mla import MultiLatentAttention
from torchtitan.models.common.rope import (
    angles,
    interleaved_table,
    inv_freqs,
    yarn_inv_freqs,
    yarn_mscale,
)

YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _config(q_lora_rank: int | None, yarn: bool) -> DeepseekV3Config:
    return DeepseekV3Config(
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        max_position_embeddings=640,
        rope_theta=10000.0,
        rope_scaling=dict(YARN) if yarn else None,
        rope_interleave=True,
        attn_implementation="sdpa",
    )


def _pair(q_lora_rank: int | None, yarn: bool) -> tuple:
    """HF's attention and ours on the same random weights, and ours' rotation table."""
    torch.manual_seed(0)
    config = _config(q_lora_rank, yarn)
    theirs = hf.DeepseekV3Attention(config, layer_idx=0).eval()
    for p in theirs.parameters():  # norms away from ones, so a skipped norm shows
        torch.nn.init.normal_(p, std=0.3 if p.ndim == 1 else 0.2)
    scale = 14**-0.5 * (yarn_mscale(40.0, 1.0) ** 2 if yarn else 1.0)
    ours = MultiLatentAttention(32, 4, q_lora_rank or 0, 12, 8, 6, 10, softmax_scale=scale)
    mapping = {
        "wkv_a": "kv_a_proj_with_mqa",
        "kv_norm": "kv_a_layernorm",
        "wkv_b": "kv_b_proj",
        "wo": "o_proj",
        **({"wq": "q_proj"} if q_lora_rank is None else {}),
        **(
            {"wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj"}
            if q_lora_rank
            else {}
        ),
    }
    ours.load_state_dict(
        {f"{o}.weight": theirs.get_submodule(t).weight.detach() for o, t in mapping.items()}
    )
    freqs = yarn_inv_freqs(6, 10000.0, 40.0, 16) if yarn else inv_freqs(6, 10000.0)
    return config, theirs, ours, interleaved_table(angles(freqs, 64))


def _hf_rotation(config: DeepseekV3Config, x: torch.Tensor) -> tuple:
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    return rotary(x, torch.arange(x.shape[1]).unsqueeze(0))


@pytest.mark.parametrize("q_lora_rank", [None, 16], ids=["q_proj", "q_lora"])
@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_mla_matches_transformers_deepseek_v3_attention(q_lora_rank, yarn):
    config, theirs, ours, table = _pair(q_lora_rank, yarn)
    assert math.isclose(ours.softmax_scale, theirs.scaling, rel_tol=1e-12)
    x = torch.randn(2, 24, 32)
    want, _ = theirs(x, _hf_rotation(config, x), attention_mask=None)
    got = ours(x, table)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()  # every weight takes part
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())


def test_mla_block_causal_is_each_document_alone():
    """Under a document mask, each packed document's output is that document run alone."""
    _, _, ours, table = _pair(16, yarn=False)
    x = torch.randn(1, 20, 32)
    doc_ids = torch.tensor([[0] * 7 + [1] * 13])
    packed = ours(x, table, document_mask(doc_ids))
    torch.testing.assert_close(packed[:, :7], ours(x[:, :7], table), rtol=1e-5, atol=1e-6)
    # the second document starts at position 7 in the packed row: the same rotation offset
    # cancels in q.k, so alone (from position 0) it gives the same result
    torch.testing.assert_close(packed[:, 7:], ours(x[:, 7:], table), rtol=1e-5, atol=1e-6)


def test_yarn_frequencies_match_transformers():
    config = _config(None, yarn=True)
    rotary = hf.DeepseekV3RotaryEmbedding(config)
    torch.testing.assert_close(
        yarn_inv_freqs(6, 10000.0, 40.0, 16).float(), rotary.inv_freq, rtol=1e-6, atol=0
    )
    assert yarn_mscale(1.0, 0.707) == 1.0
    assert math.isclose(yarn_mscale(40.0, 1.0), 0.1 * math.log(40.0) + 1.0)
