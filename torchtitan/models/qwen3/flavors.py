"""Published Qwen3 (dense) hyper-parameters, plus small debug flavors.

Sources:
* Hugging Face ``config.json`` of Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}: hidden_size
  1024/2048/2560/4096/5120/5120, num_hidden_layers 28/28/36/36/40/64, num_attention_heads
  16/16/32/32/40/64, num_key_value_heads 8 for all, head_dim 128 for all, intermediate_size
  3072/6144/9728/12288/17408/25600, tie_word_embeddings true for 0.6B/1.7B/4B and false for
  8B/14B/32B, vocab_size 151936, rms_norm_eps 1e-6, rope_theta 1000000, rope_scaling null,
  attention_bias false, max_position_embeddings 40960.
* "Qwen3 Technical Report" (arXiv:2505.09388), Table 1 (layers, query / key-value heads, tied
  embeddings and context length of each dense model) and section 2 (GQA, SwiGLU, RoPE, RMSNorm
  with pre-normalization, QK-Norm instead of Qwen2's QKV bias).
* Parameter counts, checked in ``tests/unit/models/test_qwen3.py``: the Qwen3 model cards ("Number of
  Parameters: 0.6B / 1.7B / 4.0B / 8.2B / 14.8B / 32.8B"; non-embedding 0.44B / 1.4B / 3.6B /
  6.95B / 13.2B / 31.2B).

``vocab_size`` is the published one for the real flavors and -1 for the debug flavors; the trainer
sets it from the tokenizer in any case. ``max_seq_len`` (the rotary table) is replaced by
``training.seq_len`` when training. This dict is shared: copy an entry (``dataclasses.replace``)
before changing it.
"""

from __future__ import annotations

from dataclasses import replace

from torchtitan.models.qwen3.model import Qwen3ModelArgs

__all__ = ["qwen3_configs", "QWEN3_VOCAB_SIZE", "QWEN3_TOKENIZER_SIZE"]

# Embedding rows; the byte-level BPE tokenizer itself has 151,669 tokens (technical report,
# section 2), the table is padded beyond that.
QWEN3_VOCAB_SIZE = 151936
QWEN3_TOKENIZER_SIZE = 151669


def _published(
    dim: int, n_layers: int, n_heads: int, hidden_dim: int, tied: bool
) -> Qwen3ModelArgs:
    """A published size: what every Qwen3 dense config.json shares, plus its own widths."""
    return Qwen3ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        head_dim=128,
        hidden_dim=hidden_dim,
        vocab_size=QWEN3_VOCAB_SIZE,
        tokenizer_vocab_size=QWEN3_TOKENIZER_SIZE,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=40960,
        tie_word_embeddings=tied,
    )


qwen3_configs: dict[str, Qwen3ModelArgs] = {
    # Tiny, for CPU runs and tests. Like 0.6B, the query width n_heads * head_dim (512) is twice
    # dim and the embeddings are tied; head_dim 32 != dim / n_heads (16) exercises the decoupling.
    "debugmodel": Qwen3ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=16,
        n_kv_heads=8,
        head_dim=32,
        hidden_dim=768,
        vocab_size=-1,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=2048,
        tie_word_embeddings=True,
    ),
    "0.6B": _published(dim=1024, n_layers=28, n_heads=16, hidden_dim=3072, tied=True),
    "1.7B": _published(dim=2048, n_layers=28, n_heads=16, hidden_dim=6144, tied=True),
    "4B": _published(dim=2560, n_layers=36, n_heads=32, hidden_dim=9728, tied=True),
    "8B": _published(dim=4096, n_layers=36, n_heads=32, hidden_dim=12288, tied=False),
    "14B": _published(dim=5120, n_layers=40, n_heads=40, hidden_dim=17408, tied=False),
    "32B": _published(dim=5120, n_layers=64, n_heads=64, hidden_dim=25600, tied=False),
}
# The same, untied like 8B and larger: what pipeline parallel can split (it refuses tied input
# and output embeddings, which would have to live on one rank).
qwen3_configs["debugmodel_untied"] = replace(qwen3_configs["debugmodel"], tie_word_embeddings=False)
