"""Published gpt-oss hyper-parameters, plus a small debug flavor.

Sources (docs/design/gpt_oss.md, section 1):
* Hugging Face ``config.json`` of openai/gpt-oss-20b and openai/gpt-oss-120b: hidden_size 2880,
  num_hidden_layers 24 / 36, num_local_experts 32 / 128, num_experts_per_tok 4,
  intermediate_size 2880, num_attention_heads 64, num_key_value_heads 8, head_dim 64,
  vocab_size 201088, sliding_window 128, layer_types sliding and full alternating from a
  sliding layer 0, rope_theta 150000, rope_scaling yarn (factor 32, beta_fast 32, beta_slow 1,
  original_max_position_embeddings 4096, truncate false), max_position_embeddings 131072,
  swiglu_limit 7.0, attention_bias true, rms_norm_eps 1e-5, tie_word_embeddings false.
* Parameter counts, checked in ``tests/unit/models/test_gpt_oss.py``: the model card
  (arXiv:2508.10925, Table 1): 20.91B total and 3.61B active; 116.83B and 5.13B.

``vocab_size`` is the published one for the real flavors and -1 for the debug flavor (set from
the tokenizer). Copy an entry (``dataclasses.replace``) before changing it.
"""

from __future__ import annotations

from torchtitan.models.gpt_oss.model import GptOssModelArgs, gpt_oss_moe

__all__ = ["gpt_oss_configs", "GPT_OSS_VOCAB_SIZE"]

GPT_OSS_VOCAB_SIZE = 201088


def _published(n_layers: int, num_experts: int) -> GptOssModelArgs:
    """A published size: what both config.json files share, plus depth and experts."""
    return GptOssModelArgs(
        dim=2880,
        n_layers=n_layers,
        n_heads=64,
        n_kv_heads=8,
        head_dim=64,
        vocab_size=GPT_OSS_VOCAB_SIZE,
        max_seq_len=131072,
        sliding_window=128,
        moe=gpt_oss_moe(num_experts, top_k=4, hidden_dim=2880),
    )


gpt_oss_configs: dict[str, GptOssModelArgs] = {
    # Tiny, for CPU runs and tests: 4 layers (sliding, full, sliding, full), 8 experts, top-4 as
    # published; a window of 32 keys, a quarter of the debug config's sequence of 128, so every
    # run and layout crosses it; 2 kv heads (tensor parallel 2 splits whole groups).
    "debugmodel": GptOssModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        head_dim=32,
        vocab_size=-1,
        max_seq_len=2048,
        sliding_window=32,
        moe=gpt_oss_moe(num_experts=8, top_k=4, hidden_dim=256),
    ),
    "20b": _published(n_layers=24, num_experts=32),
    "120b": _published(n_layers=36, num_experts=128),
}
