"""DeepSeek-V3 (and Kimi K2, Moonlight, DeepSeek-V2's V3-style sizes): model math only.

From ``transformers``' ``modeling_deepseek_v3.py`` and the DeepSeek-V3 technical report
(arXiv:2412.19437, section 2.1):

* Attention is multi-head latent attention (:mod:`torchtitan.models.common.mla`): queries
  through an optional low-rank pair (``q_lora_rank``, 0 = one projection), keys and values
  from a ``kv_lora_rank`` latent, a ``qk_rope_head_dim`` rotary part (one key shared by the
  heads) beside ``qk_nope_head_dim`` unrotated channels, values of ``v_head_dim``. The latent
  norms use eps 1e-6 whatever ``rms_norm_eps`` says (as ``transformers`` builds them).
* Rotary channels as interleaved pairs (DeepSeek's weights), YaRN when ``rope_factor`` > 1:
  NTK-by-parts frequencies over ``rope_original_seq_len`` and the softmax scale times
  ``yarn_mscale(rope_factor, rope_mscale) ** 2`` (``mscale_all_dim``).
* Feed-forward: the first ``moe.first_dense`` layers dense SwiGLU of ``hidden_dim``, the rest
  DeepSeekMoE (:mod:`torchtitan.models.common.moe`): sigmoid scores, the correction bias
  choosing, group-limited top-k, renormalized weights times ``route_scale``, shared experts.
* No tied embeddings; pre-norm blocks; a final RMSNorm.
* ``num_mtp_layers`` multi-token-prediction depths (section 2.2; :mod:`~torchtitan.models.common.mtp`)
  after the main layers, sharing the embedding and the output head.

Parameter names follow this library's (``attention.wq`` or ``wq_a``/``q_norm``/``wq_b``,
``wkv_a``/``kv_norm``/``wkv_b``, ``wo``; ``feed_forward`` or ``moe``), so the generic
parallelisms name the same modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchtitan.models.common import rope
from torchtitan.models.common.attention import ATTN_MASK_TYPES
from torchtitan.models.common.blocks import TransformerBlock
from torchtitan.models.common.decoder import Decoder
from torchtitan.models.common.mla import MultiLatentAttention
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.norms.rmsnorm import NORM_TYPES, build_norm

__all__ = ["DeepSeekV3ModelArgs", "DeepSeekV3Model"]

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers' default, not rms_norm_eps


@dataclass
class DeepSeekV3ModelArgs:
    """Hyper-parameters of one flavor (``config.json`` name in brackets)."""

    dim: int = 7168  # hidden_size
    n_layers: int = 61  # num_hidden_layers
    n_heads: int = 128  # num_attention_heads
    hidden_dim: int = 18432  # intermediate_size: the dense layers' SwiGLU width
    q_lora_rank: int = 1536  # q_lora_rank (null in config.json: 0 here)
    kv_lora_rank: int = 512  # kv_lora_rank
    qk_nope_head_dim: int = 128  # qk_nope_head_dim
    qk_rope_head_dim: int = 64  # qk_rope_head_dim
    v_head_dim: int = 128  # v_head_dim
    vocab_size: int = -1  # vocab_size; -1: set from the tokenizer at build time
    tokenizer_vocab_size: int | None = field(default=None, compare=False)
    norm_eps: float = 1e-6  # rms_norm_eps
    rope_theta: float = 10000.0  # rope_theta
    # rope_scaling (YaRN): factor (1: none), original_max_position_embeddings, beta_fast,
    # beta_slow, mscale_all_dim
    rope_factor: float = 1.0
    rope_original_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    max_seq_len: int = 4096  # length of the precomputed rotary table
    tie_word_embeddings: bool = False
    depth_init: bool = True
    norm_type: str = "rmsnorm"
    attn_mask_type: str = field(default="causal", compare=False)
    moe: MoEArgs = field(default_factory=MoEArgs)
    # num_nextn_predict_layers: multi-token-prediction depths (models/common/mtp.py), each a
    # block like the last main one (a MoE block), after the main layers
    num_mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type {self.norm_type!r} is not one of: {', '.join(NORM_TYPES)}")
        if self.attn_mask_type not in ATTN_MASK_TYPES:
            raise ValueError(
                f"attn_mask_type {self.attn_mask_type!r} is not one of: "
                f"{', '.join(ATTN_MASK_TYPES)}"
            )
        if self.qk_rope_head_dim % 2 != 0:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even")
        if self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers ({self.num_mtp_layers}) must be >= 0")
        if self.q_lora_rank < 0 or self.kv_lora_rank < 1:
            raise ValueError(
                f"q_lora_rank ({self.q_lora_rank}) must be >= 0 and kv_lora_rank "
                f"({self.kv_lora_rank}) >= 1"
            )

    @property
    def n_kv_heads(self) -> int:
        """Every head has its own keys and values once the latent is expanded."""
        return self.n_heads

    @property
    def head_dim(self) -> int:
        """The mean of the query/key and value head widths: ``6 * T * n_heads * head_dim`` is
        then the attention FLOPs per token and layer (``Q K^T`` over the first, ``A V`` over
        the second; see ``get_nparams_and_flops``)."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim) // 2

    def ffn_hidden_dim(self) -> int:
        """The width tensor parallelism splits: every expert's."""
        return self.moe.hidden_dim

    def softmax_scale(self) -> float:
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope_factor > 1:
            scale *= rope.yarn_mscale(self.rope_factor, self.rope_mscale) ** 2
        return scale


class DeepSeekV3Model(Decoder):
    """The DeepSeek-V3 decoder (see the module doc); init as the shared blocks (projections
    into attention and experts std 0.02, output-side depth-scaled, norms one)."""

    def build_block(self, layer_id: int, args: DeepSeekV3ModelArgs) -> nn.Module:
        attention = MultiLatentAttention(
            args.dim,
            args.n_heads,
            args.q_lora_rank,
            args.kv_lora_rank,
            args.qk_nope_head_dim,
            args.qk_rope_head_dim,
            args.v_head_dim,
            softmax_scale=args.softmax_scale(),
            norm_type=args.norm_type,
            norm_eps=LATENT_NORM_EPS,
        )
        return TransformerBlock(layer_id, args, attention, args.hidden_dim)

    def build_rope_cache(
        self, args: DeepSeekV3ModelArgs, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """``[max_seq_len, qk_rope_head_dim // 2, 2]`` float32: interleaved pairs."""
        if args.rope_factor > 1:
            freqs = rope.yarn_inv_freqs(
                args.qk_rope_head_dim,
                args.rope_theta,
                args.rope_factor,
                args.rope_original_seq_len,
                args.rope_beta_fast,
                args.rope_beta_slow,
            )
        else:
            freqs = rope.inv_freqs(args.qk_rope_head_dim, args.rope_theta)
        return rope.interleaved_table(rope.angles(freqs.to(device), args.max_seq_len))

    def build_norm(self, args: Any) -> nn.Module:
        return build_norm(args.norm_type, args.dim, args.norm_eps)
