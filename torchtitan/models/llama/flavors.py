"""Published Llama 2 and Llama 3 (3.1, 3.2) hyper-parameters, plus small debug flavors.

Sources:
* Llama 2: Meta's ``params.json`` of each checkpoint and the Hugging Face ``config.json`` of
  meta-llama/Llama-2-{7b,13b,70b}-hf (hidden 4096/5120/8192, 32/40/80 layers, 32/40/64 heads,
  70B: 8 kv heads, intermediate 11008/13824/28672, vocab 32000, context 4096, rms eps 1e-5).
* Llama 3.1: Meta's llama-models ``sku_list.py`` model args (8B: multiple_of 1024, multiplier 1.3;
  70B: 4096, 1.3; 405B: 4096, 1.2; rope_theta 500000, use_scaled_rope) and "The Llama 3 Herd of
  Models" (arXiv:2407.21783) Table 3 (FFN 14336 / 28672 / 53248, 8 kv heads); vocab 128256.
* Llama 3.2: HF ``config.json`` of meta-llama/Llama-3.2-{1B,3B} (hidden 2048/3072, 16/28 layers,
  32/24 heads, 8 kv heads, intermediate 8192, tie_word_embeddings true, rope_scaling factor 32.0,
  low 1.0, high 4.0, original_max_position_embeddings 8192, max_position_embeddings 131072).

``vocab_size`` is the published one for the real flavors and -1 for the debug flavors; the
trainer sets it from the tokenizer in any case. These dicts are shared: copy an entry
(``dataclasses.replace``) before changing it.
"""

from __future__ import annotations

from torchtitan.models.llama.model import ModelArgs

__all__ = ["llama2_configs", "llama3_configs", "LLAMA2_VOCAB_SIZE", "LLAMA3_VOCAB_SIZE"]

LLAMA2_VOCAB_SIZE = 32000  # SentencePiece tokenizer of Llama 2
LLAMA3_VOCAB_SIZE = 128256  # tiktoken tokenizer of Llama 3: 128000 BPE + 256 special tokens


llama2_configs: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        multiple_of=256,
        rope_theta=10000.0,
        max_seq_len=2048,
    ),
    "7B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        vocab_size=LLAMA2_VOCAB_SIZE,
        multiple_of=256,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=4096,
    ),
    "13B": ModelArgs(
        dim=5120,
        n_layers=40,
        n_heads=40,
        vocab_size=LLAMA2_VOCAB_SIZE,
        multiple_of=256,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=4096,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=LLAMA2_VOCAB_SIZE,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=10000.0,
        max_seq_len=4096,
    ),
}


llama3_configs: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        multiple_of=256,
        rope_theta=500000.0,
        max_seq_len=2048,
    ),
    # Llama 3.2 (text): pruned/distilled small models with shared input/output embeddings and
    # rope scaling factor 32 (not 3.1's 8).
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        norm_eps=1e-5,
        rope_theta=500000.0,
        use_scaled_rope=True,
        rope_scale_factor=32.0,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        norm_eps=1e-5,
        rope_theta=500000.0,
        use_scaled_rope=True,
        rope_scale_factor=32.0,
        max_seq_len=131072,
        tie_word_embeddings=True,
    ),
    # Llama 3.1: 128K context through rope scaling factor 8.
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        use_scaled_rope=True,
        max_seq_len=131072,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        norm_eps=1e-5,
        rope_theta=500000.0,
        use_scaled_rope=True,
        max_seq_len=131072,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        norm_eps=1e-5,
        rope_theta=500000.0,
        use_scaled_rope=True,
        max_seq_len=131072,
    ),
}
