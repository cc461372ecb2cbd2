"""The Llama 2 / Llama 3 (3.1, 3.2) decoder: model math only, no parallelism.

Layout follows Meta's reference checkpoints (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``,
interleaved-pair rotary embeddings), so their ``consolidated.*.pth`` weights load by name.
Hugging Face checkpoints use a half-split rotary layout: their ``q_proj``/``k_proj`` rows must be
permuted when converted.

Intended construction (the parallelisms may be applied between the steps)::

    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cuda")
    model.init_weights()

Pipeline stages may set ``tok_embeddings``, ``norm`` or ``output`` to ``None`` and delete entries
of ``layers``; :meth:`Transformer.forward` then passes its input through the missing parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.models.common import rope
from torchtitan.models.common.blocks import (
    FeedForward,
    GroupedQueryAttention,
    TransformerBlock,
)
from torchtitan.models.common.decoder import Decoder, check_decoder_args, get_nparams_and_flops
from torchtitan.models.common.norms.rmsnorm import NORM_TYPES, RMSNorm, build_norm

__all__ = [
    "ModelArgs",
    "NORM_TYPES",
    "RMSNorm",
    "build_norm",
    "Attention",
    "FeedForward",
    "TransformerBlock",
    "Transformer",
    "rope_inv_freqs",
    "precompute_rope_cache",
    "apply_rotary_emb",
    "get_nparams_and_flops",
]


@dataclass
class ModelArgs:
    """Hyper-parameters of one Llama flavor (names follow Meta's ``params.json``)."""

    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (plain multi-head attention)
    vocab_size: int = -1  # -1: set from the tokenizer at build time
    multiple_of: int = 256  # SwiGLU hidden size is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1-style frequency scaling of the rotary embedding. Defaults are the 3.1 constants
    # (Meta's reference `apply_scaling`; HF config "rope_scaling" of Llama-3.1-8B: factor 8,
    # low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192).
    use_scaled_rope: bool = False
    rope_scale_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 2048  # length of the precomputed rotary table
    tie_word_embeddings: bool = False  # output.weight is tok_embeddings.weight
    depth_init: bool = True  # scale wo/w2 init by the layer's depth rather than by n_layers
    # RMSNorm implementation (same math and parameter, see torchtitan/models/common/norms/rmsnorm.py)
    norm_type: str = "rmsnorm"
    # "causal" or "block_causal" (attention within packed documents, see models/common/attention.py);
    # how a run trains, not an architecture setting: not in config.json, not compared
    attn_mask_type: str = field(default="causal", compare=False)

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        check_decoder_args(self)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size: 2/3 of 4*dim (same parameter count as a 4*dim GELU MLP),
        optionally scaled by ``ffn_dim_multiplier``, then rounded up to ``multiple_of``.

        This is the rule of Meta's reference ``FeedForward`` (e.g. 4096 -> 11008 for Llama 2 7B,
        and 14336 for Llama 3 8B with multiplier 1.3 and multiple_of 1024).
        """
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


# --------------------------------------------------------------------------------------------
# Rotary position embeddings
# --------------------------------------------------------------------------------------------


def rope_inv_freqs(args: ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotation frequencies (radians per position), shape ``[head_dim // 2]``, float64: pair
    ``i`` rotates at ``rope_theta ** (-2i / head_dim)``, with ``use_scaled_rope`` the Llama 3.1
    rule (:func:`~torchtitan.models.common.rope.llama3_scaled`)."""
    freqs = rope.inv_freqs(args.head_dim, args.rope_theta, device)
    if not args.use_scaled_rope:
        return freqs
    return rope.llama3_scaled(
        freqs,
        args.rope_original_max_seq_len,
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_scale_factor,
    )


def precompute_rope_cache(
    args: ModelArgs, device: torch.device | str | None = None
) -> torch.Tensor:
    """Cos/sin table ``[max_seq_len, head_dim // 2, 2]`` (float32) for positions 0..max_seq_len-1,
    Meta's interleaved layout (:mod:`torchtitan.models.common.rope`)."""
    return rope.interleaved_table(rope.angles(rope_inv_freqs(args, device), args.max_seq_len))


apply_rotary_emb = rope.apply_interleaved


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class Attention(GroupedQueryAttention):
    """Causal grouped-query self-attention with Meta's interleaved rotary embeddings (no biases,
    no dropout), through one fused ``wqkv`` projection (see
    :class:`~torchtitan.models.common.blocks.GroupedQueryAttention`)."""

    def __init__(self, args: ModelArgs) -> None:
        assert args.n_kv_heads is not None
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rotary_emb)


class Transformer(Decoder):
    """Llama decoder: token embedding, ``n_layers`` blocks, final RMSNorm, output projection
    (the shared skeleton and init of :class:`~torchtitan.models.common.decoder.Decoder`).

    Weight init: wq/wk/wv/w1/w3 truncated normal std 0.02; wo/w2 std
    ``0.02 / sqrt(2 * (layer_id + 1))`` (``depth_init``) or ``0.02 / sqrt(2 * n_layers)``.
    """

    def build_block(self, layer_id: int, args: ModelArgs) -> nn.Module:
        return TransformerBlock(layer_id, args, Attention(args), args.ffn_hidden_dim())

    def build_rope_cache(
        self, args: ModelArgs, device: torch.device | str | None = None
    ) -> torch.Tensor:
        return precompute_rope_cache(args, device=device)

    def build_norm(self, args: ModelArgs) -> nn.Module:
        return build_norm(args.norm_type, args.dim, args.norm_eps)
