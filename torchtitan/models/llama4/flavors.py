"""Published Llama 4 (text) hyper-parameters, plus small debug flavors.

Sources: the ``text_config`` of Hugging Face ``config.json`` of meta-llama/Llama-4-Scout-17B-16E
and meta-llama/Llama-4-Maverick-17B-128E: hidden_size 5120, num_hidden_layers 48,
num_attention_heads 40, num_key_value_heads 8, head_dim 128, intermediate_size 8192 (each expert
and the shared expert), intermediate_size_mlp 16384 (dense layers), num_experts_per_tok 1,
vocab_size 202048, rms_norm_eps 1e-5, rope_theta 500000, attention_chunk_size 8192,
no_rope_layer_interval 4 (default), attn_temperature_tuning on, floor_scale 8192,
attn_scale 0.1, tie_word_embeddings false; Scout: num_local_experts 16,
interleave_moe_layer_step 1, use_qk_norm true, rope_scaling llama3 (factor 16, low_freq_factor
1, high_freq_factor 1, original_max_position_embeddings 8192); Maverick: num_local_experts 128,
interleave_moe_layer_step 2, use_qk_norm false, no rope_scaling.
Parameter counts, checked in ``tests/unit/models/test_moe_families.py``: the model cards' "17B activated,
109B total" (Scout) and "17B activated, 400B total" (Maverick); those totals include the
vision encoder, which the text model here does not have.
"""

from __future__ import annotations

from dataclasses import replace

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.llama4.model import Llama4ModelArgs

__all__ = ["llama4_configs", "LLAMA4_VOCAB_SIZE"]

LLAMA4_VOCAB_SIZE = 202048


def _moe(num_experts: int, width: int, every: int = 1) -> MoEArgs:
    """Llama 4's routing: sigmoid scores, top-1, the score scaling the expert's input, one
    shared expert as wide as a routed one."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=1,
        hidden_dim=width,
        score_func="sigmoid",
        score_before_experts=True,
        shared_hidden_dim=width,
        every=every,
    )


def _published(num_experts: int, every: int, qk_norm: bool, scaled_rope: bool) -> Llama4ModelArgs:
    return Llama4ModelArgs(
        dim=5120,
        n_layers=48,
        n_heads=40,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=16384,
        vocab_size=LLAMA4_VOCAB_SIZE,
        norm_eps=1e-5,
        rope_theta=500_000.0,
        use_scaled_rope=scaled_rope,
        rope_scale_factor=16.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=1.0,
        rope_original_max_seq_len=8192,
        max_seq_len=8192,
        attention_chunk_size=8192,
        use_qk_norm=qk_norm,
        moe=_moe(num_experts, 8192, every),
    )


llama4_configs: dict[str, Llama4ModelArgs] = {
    # Tiny, for CPU runs and tests: 8 experts top-1 with a shared expert, MoE on every layer,
    # layer 3 NoPE, chunks of 32 tokens on the rotary layers (so sequences of 64 and more are
    # chunked), QK-norm on
    "debugmodel": Llama4ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        hidden_dim=512,
        vocab_size=-1,
        max_seq_len=2048,
        attention_chunk_size=32,
        moe=_moe(8, 256),
    ),
    "17bx16e": _published(16, every=1, qk_norm=True, scaled_rope=True),
    "17bx128e": _published(128, every=2, qk_norm=False, scaled_rope=False),
}
# Maverick's layout at debug size: dense and MoE layers alternating, no QK-norm
llama4_configs["debugmodel_interleaved"] = replace(
    llama4_configs["debugmodel"], use_qk_norm=False, moe=_moe(8, 256, every=2)
)
