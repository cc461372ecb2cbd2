"""DeepSeek-V3-architecture flavors: the published sizes and a debug flavor.

Sources (``config.json`` values; counts in ``tests/unit/models/test_deepseek_v3.py``):

* ``16B``: Moonshot's Moonlight-16B-A3B, the DeepSeek-V3 architecture at DeepSeek-V2-Lite's shape
  (hidden 2048, 27 layers with the first dense, 16 heads, no query compression, 64 experts of
  width 1408 plus 2 shared, top-6, sigmoid routing with the correction bias, one group,
  routed_scaling_factor 2.446, vocab 163840, rms_norm_eps 1e-5, rope_theta 50000, no rope
  scaling). The Moonlight README gives 15.29B parameters and 2.24B activated without the
  embeddings ("16B total / 3B activated" with them).
* ``236B``: DeepSeek-V2's shape (hidden 5120, 60 layers with the first dense, 128 heads, q_lora
  1536, 160 experts of 1536 plus 2 shared, top-6 from 3 of 8 groups, routed_scaling_factor 16,
  vocab 102400, YaRN factor 40 with mscale 0.707). DeepSeek-V2 routes by softmax with greedy
  group limiting; this flavor routes the DeepSeek-V3 way (sigmoid, bias, top-2-sum groups), as
  upstream torchtitan's 236B does with its own settings. Published: 236B total, 21B activated
  (DeepSeek-V2 README).
* ``671B``: DeepSeek-V3 (hidden 7168, 61 layers with the first 3 dense, 128 heads, q_lora 1536,
  256 experts of 2048 plus 1 shared, top-8 from 4 of 8 groups, routed_scaling_factor 2.5, vocab
  129280, YaRN factor 40 with mscale 1.0). Published: 671B total and 37B activated (technical
  report, arXiv:2412.19437 section 4.2), without the 14B of the multi-token-prediction module.
* ``kimi_k2``: Kimi K2 (hidden 7168, 61 layers with the first dense, 64 heads, q_lora 1536, 384
  experts of 2048 plus 1 shared, top-8, one group, routed_scaling_factor 2.827, vocab 163840,
  rope_theta 50000, YaRN factor 32 with beta_fast = beta_slow = 1). Published: "1T total, 32B
  activated" (Kimi-K2 README and the report's abstract, arXiv:2507.20534; the 1.04T and 32.6B
  often quoted for the report come from secondary sources only).

Counted here (``tests/unit/models/test_deepseek_v3.py``; active = everything but the routed
experts a token does not use): 16B 15.960B / 2.915B (15.289B / 2.244B without the embedding and
output: Moonlight's figures); 236B 235.7B / 21.38B; 671B 671.03B / 37.55B; kimi_k2 1026.4B /
32.86B. DeepSeek counts activated parameters without the input embedding (a lookup) but with the
output head (README_WEIGHTS.md: 36.6B "including 0.9B for the output Head"). So read, every
published figure is met to the digits it was published with: 236B 20.85B active (21B), 671B
36.63B (36.6B; 37B in the report), kimi_k2 31.69B (32B) and 1.03T total (1T). README_WEIGHTS'
figures for the MTP module, 11.5B unique and 1.5B activated with the head, are the depth without
its ``eh_proj`` (0.10B).

Every published flavor has qk_nope 128, qk_rope 64, v 128 and kv_lora 512. ``vocab_size`` is the
published one; the debug flavor takes the tokenizer's. Pretraining from scratch used plain rope
(the report's section 4.3: YaRN came with the context extension); the flavors keep the published
YaRN so that released checkpoints load and agree.
"""

from __future__ import annotations

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.deepseek_v3.model import DeepSeekV3ModelArgs

__all__ = ["deepseek_v3_configs"]


def _published(**kw) -> DeepSeekV3ModelArgs:
    return DeepSeekV3ModelArgs(
        **{
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "rope_original_seq_len": 4096,
            **kw,
        }
    )


def _moe(experts: int, shared: int, top_k: int, groups: int, best: int, scale: float, first: int):
    return MoEArgs(
        num_experts=experts,
        top_k=top_k,
        hidden_dim=0,  # set below
        score_func="sigmoid",
        route_norm=True,
        route_scale=scale,
        num_groups=groups,
        topk_groups=best,
        first_dense=first,
        shared_hidden_dim=shared,
        load_balance_coeff=1e-3,
    )


def _experts(width: int, **kw) -> MoEArgs:
    moe = _moe(**kw)
    moe.hidden_dim, moe.shared_hidden_dim = width, width * moe.shared_hidden_dim
    return moe


deepseek_v3_configs: dict[str, DeepSeekV3ModelArgs] = {
    # Tiny, for CPU runs and tests: 4 layers (the first dense), query compression, 8 experts in
    # 4 groups (2 of them chosen) with 1 shared, YaRN as the published sizes have it.
    "debugmodel": DeepSeekV3ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        hidden_dim=768,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        vocab_size=-1,
        norm_eps=1e-6,
        rope_factor=4.0,
        rope_original_seq_len=512,
        max_seq_len=2048,
        num_mtp_layers=1,
        moe=_experts(256, experts=8, shared=1, top_k=2, groups=4, best=2, scale=2.5, first=1),
    ),
    "16B": _published(
        dim=2048,
        n_layers=27,
        n_heads=16,
        hidden_dim=11264,
        q_lora_rank=0,
        vocab_size=163840,
        norm_eps=1e-5,
        rope_theta=50000.0,
        max_seq_len=8192,
        moe=_experts(1408, experts=64, shared=2, top_k=6, groups=1, best=1, scale=2.446, first=1),
    ),
    "236B": _published(
        dim=5120,
        n_layers=60,
        n_heads=128,
        hidden_dim=12288,
        q_lora_rank=1536,
        vocab_size=102400,
        rope_factor=40.0,
        rope_mscale=0.707,
        max_seq_len=163840,
        moe=_experts(1536, experts=160, shared=2, top_k=6, groups=8, best=3, scale=16.0, first=1),
    ),
    "671B": _published(
        dim=7168,
        n_layers=61,
        n_heads=128,
        hidden_dim=18432,
        q_lora_rank=1536,
        vocab_size=129280,
        rope_factor=40.0,
        rope_mscale=1.0,
        max_seq_len=163840,
        num_mtp_layers=1,
        moe=_experts(2048, experts=256, shared=1, top_k=8, groups=8, best=4, scale=2.5, first=3),
    ),
    "kimi_k2": _published(
        dim=7168,
        n_layers=61,
        n_heads=64,
        hidden_dim=18432,
        q_lora_rank=1536,
        vocab_size=163840,
        rope_theta=50000.0,
        rope_factor=32.0,
        rope_beta_fast=1.0,
        rope_beta_slow=1.0,
        rope_mscale=1.0,
        max_seq_len=131072,
        moe=_experts(2048, experts=384, shared=1, top_k=8, groups=1, best=1, scale=2.827, first=1),
    ),
}
