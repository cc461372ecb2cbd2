"""Published Qwen3-Next hyper-parameters, plus a small debug flavor.

Sources (docs/design/qwen3_next.md, section 1): the ``config.json`` of
Qwen/Qwen3-Next-80B-A3B-Instruct: hidden_size 2048, num_hidden_layers 48,
full_attention_interval 4, num_attention_heads 16, num_key_value_heads 2, head_dim 256,
partial_rotary_factor 0.25, rope_theta 10000000, max_position_embeddings 262144,
linear_num_key_heads 16, linear_num_value_heads 32, linear_key_head_dim 128,
linear_value_head_dim 128, linear_conv_kernel_dim 4, num_experts 512, num_experts_per_tok 10,
moe_intermediate_size 512, shared_expert_intermediate_size 512, norm_topk_prob true,
decoder_sparse_step 1, intermediate_size 5120, rms_norm_eps 1e-6, tie_word_embeddings false,
vocab_size 151936. The parameter counts are checked against the model card's "80B total
parameters, 3B activated" in ``tests/unit/models/test_qwen3_next.py``.

``vocab_size`` is the published one for the real flavor and -1 for the debug flavor (set from
the tokenizer). Copy an entry (``dataclasses.replace``) before changing it.
"""

from __future__ import annotations

from torchtitan.models.qwen3.flavors import QWEN3_TOKENIZER_SIZE, QWEN3_VOCAB_SIZE
from torchtitan.models.qwen3_next.model import Qwen3NextModelArgs, qwen3_next_moe

__all__ = ["qwen3_next_configs"]

qwen3_next_configs: dict[str, Qwen3NextModelArgs] = {
    # Tiny, for CPU runs and tests: 4 layers, linear and full attention alternating (every
    # other layer full, not every fourth: the layout suites cut the model to 2 blocks and keep
    # one of each), 8 experts top-2 with a gated shared expert; head_dim 64 with a quarter
    # rotated, as published.
    "debugmodel": Qwen3NextModelArgs(
        dim=256,
        n_layers=4,
        full_attention_interval=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        hidden_dim=512,
        vocab_size=-1,
        rope_theta=10_000_000.0,
        max_seq_len=4096,
        linear_n_key_heads=2,
        linear_n_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        moe=qwen3_next_moe(num_experts=8, top_k=2, hidden_dim=128, shared_dim=128),
    ),
    # with the published checkpoint's one prediction depth (mtp.*)
    "80B-A3B": Qwen3NextModelArgs(
        vocab_size=QWEN3_VOCAB_SIZE,
        tokenizer_vocab_size=QWEN3_TOKENIZER_SIZE,
        num_mtp_layers=1,
    ),
}
