"""Published Qwen3-MoE hyper-parameters, plus small debug flavors.

Sources:
* Hugging Face ``config.json`` of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B: hidden_size
  2048 / 4096, num_hidden_layers 48 / 94, num_attention_heads 32 / 64, num_key_value_heads 4 / 4,
  head_dim 128, intermediate_size 6144 / 12288 (no layer is dense: decoder_sparse_step 1,
  mlp_only_layers []), moe_intermediate_size 768 / 1536, num_experts 128, num_experts_per_tok 8,
  norm_topk_prob true, vocab_size 151936, tie_word_embeddings false, rms_norm_eps 1e-6,
  rope_theta 1000000, max_position_embeddings 40960, router_aux_loss_coef 0.001.
* "Qwen3 Technical Report" (arXiv:2505.09388), Table 2 (layers, heads, 128 experts with 8
  activated, no shared experts) and section 2 (global-batch load balancing loss).
* Parameter counts, checked in ``tests/unit/models/test_moe_families.py``: the model cards ("Number of
  Parameters: 30.5B in total and 3.3B activated"; "235B in total and 22B activated").

``vocab_size`` is the published one for the real flavors and -1 for the debug flavors (set from
the tokenizer). Copy an entry (``dataclasses.replace``) before changing it.
"""

from __future__ import annotations

from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3.flavors import QWEN3_TOKENIZER_SIZE, QWEN3_VOCAB_SIZE
from torchtitan.models.qwen3_moe.model import Qwen3MoeModelArgs

__all__ = ["qwen3_moe_configs"]


def _published(
    dim: int, n_layers: int, n_heads: int, hidden_dim: int, expert_dim: int
) -> Qwen3MoeModelArgs:
    """A published size: what both Qwen3-MoE config.json files share, plus their widths."""
    return Qwen3MoeModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=4,
        head_dim=128,
        hidden_dim=hidden_dim,
        vocab_size=QWEN3_VOCAB_SIZE,
        tokenizer_vocab_size=QWEN3_TOKENIZER_SIZE,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=40960,
        tie_word_embeddings=False,
        moe=MoEArgs(num_experts=128, top_k=8, hidden_dim=expert_dim, route_norm=True),
    )


qwen3_moe_configs: dict[str, Qwen3MoeModelArgs] = {
    # Tiny, for CPU runs and tests: 8 experts, top-2, untied (pipeline parallel can split it);
    # head_dim 32 != dim / n_heads as in the published sizes.
    "debugmodel": Qwen3MoeModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        hidden_dim=768,
        vocab_size=-1,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_seq_len=2048,
        tie_word_embeddings=False,
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, route_norm=True),
    ),
    "30B-A3B": _published(dim=2048, n_layers=48, n_heads=32, hidden_dim=6144, expert_dim=768),
    "235B-A22B": _published(dim=4096, n_layers=94, n_heads=64, hidden_dim=12288, expert_dim=1536),
}
