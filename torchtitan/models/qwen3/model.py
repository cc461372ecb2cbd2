"""The Qwen3 dense decoder: model math only, no parallelism.

Differences from Llama (``torchtitan/models/llama/model.py``), all taken from ``transformers``'
``modeling_qwen3.py`` and the Qwen3 technical report (arXiv:2505.09388, section 2):

* ``head_dim`` is a hyper-parameter of its own (128 in every published size), not
  ``dim / n_heads``: ``wq`` maps ``dim -> n_heads * head_dim``, ``wo`` maps it back.
* QK-norm: an RMSNorm over ``head_dim`` (one ``[head_dim]`` scale shared by all heads) applied to
  every query and key head after the projection and before the rotary embedding.
* Rotary embeddings in ``transformers``' half-split layout: channel ``i`` of a head pairs with
  channel ``i + head_dim / 2`` (``rotate_half``), so Hugging Face weights load without any
  permutation. ``rope_theta`` is 1,000,000; no frequency scaling.
* The SwiGLU width is the explicit ``hidden_dim`` (``intermediate_size``), RMSNorm eps 1e-6.

Parameter names follow this library's Llama (``wq``/``wk``/``wv``/``wo``, ``w1``/``w2``/``w3``,
``attention_norm``/``ffn_norm``) plus ``attention.q_norm`` / ``attention.k_norm``, so the generic
parallelisms and the tensor-parallel plan name the same modules.

Intended construction (the parallelisms may be applied between the steps)::

    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cuda")
    model.init_weights()
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchtitan.models.common import rope
from torchtitan.models.common.blocks import GroupedQueryAttention, TransformerBlock
from torchtitan.models.common.decoder import Decoder, check_decoder_args, get_nparams_and_flops
from torchtitan.models.common.norms.rmsnorm import build_norm

__all__ = [
    "Qwen3ModelArgs",
    "Qwen3Attention",
    "Qwen3Model",
    "rope_inv_freqs",
    "precompute_rope_cache",
    "apply_rotary_emb",
    "get_nparams_and_flops",
]


@dataclass
class Qwen3ModelArgs:
    """Hyper-parameters of one Qwen3 flavor (``config.json`` name in brackets)."""

    dim: int = 4096  # hidden_size
    n_layers: int = 36  # num_hidden_layers
    n_heads: int = 32  # num_attention_heads
    n_kv_heads: int | None = 8  # num_key_value_heads; None: same as n_heads
    head_dim: int = 128  # head_dim (independent of dim / n_heads)
    hidden_dim: int = 12288  # intermediate_size: SwiGLU width
    vocab_size: int = -1  # vocab_size; -1: set from the tokenizer at build time
    # the tokens of the flavor's own tokenizer when the embedding table is padded beyond them
    # (not an architecture setting: not in config.json, not compared)
    tokenizer_vocab_size: int | None = field(default=None, compare=False)
    norm_eps: float = 1e-6  # rms_norm_eps (every RMSNorm, the QK norms included)
    rope_theta: float = 1_000_000.0  # rope_theta
    max_seq_len: int = 4096  # length of the precomputed rotary table
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
        check_decoder_args(self)

    def ffn_hidden_dim(self) -> int:
        """SwiGLU hidden size (what preflight checks against the tensor-parallel degree)."""
        return self.hidden_dim


# --------------------------------------------------------------------------------------------
# Rotary position embeddings, half-split layout
# --------------------------------------------------------------------------------------------


def rope_inv_freqs(args: Qwen3ModelArgs, device: torch.device | str | None = None) -> torch.Tensor:
    """Rotation frequencies ``rope_theta ** (-2i / head_dim)``, shape ``[head_dim // 2]``,
    float64 (``transformers``' default rope computes the same values in float32)."""
    return rope.inv_freqs(args.head_dim, args.rope_theta, device)


def precompute_rope_cache(
    args: Qwen3ModelArgs, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[max_seq_len, 2, head_dim]`` float32, the half-split layout
    (:mod:`torchtitan.models.common.rope`)."""
    return rope.half_split_table(rope.angles(rope_inv_freqs(args, device), args.max_seq_len))


apply_rotary_emb = rope.apply_half_split


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class Qwen3Attention(GroupedQueryAttention):
    """Causal grouped-query self-attention with QK-norm and half-split rotary embeddings (no
    biases), through one fused ``wqkv`` projection (see
    :class:`~torchtitan.models.common.blocks.GroupedQueryAttention`).

    The QK norms act on each head separately and work on any subset of the heads, so tensor
    parallelism's whole-group shards of ``wqkv`` need nothing more (see ``qwen3/parallelize.py``).
    """

    def __init__(self, args: Qwen3ModelArgs) -> None:
        assert args.n_kv_heads is not None
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rotary_emb)
        self.q_norm = build_norm(args.norm_type, args.head_dim, args.norm_eps)
        self.k_norm = build_norm(args.norm_type, args.head_dim, args.norm_eps)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None) -> torch.Tensor:
        xq, xk, xv = self.project(x)
        # SDPA's default scale is head_dim ** -0.5, as in Qwen3
        xq, xk = self.rotary(self.q_norm(xq), self.k_norm(xk), rope_cache)
        return self.attend(xq, xk, xv, mask)

    def init_weights(self, init_std: float) -> None:
        """wqkv: truncated normal std 0.02; wo: the given (depth-scaled) std; QK norms: 1."""
        super().init_weights(init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class Qwen3Model(Decoder):
    """Qwen3 decoder: token embedding, ``n_layers`` blocks, final RMSNorm, output projection
    (tied to the embedding for the small flavors); the skeleton and init of
    :class:`~torchtitan.models.common.decoder.Decoder`.

    Weight init: wq/wk/wv/w1/w3 truncated normal std 0.02; wo/w2 std
    ``0.02 / sqrt(2 * (layer_id + 1))`` (``depth_init``) or ``0.02 / sqrt(2 * n_layers)``; every
    RMSNorm (QK norms included) to one.
    """

    def build_block(self, layer_id: int, args: Qwen3ModelArgs) -> nn.Module:
        return TransformerBlock(layer_id, args, Qwen3Attention(args), args.hidden_dim)

    def build_rope_cache(
        self, args: Qwen3ModelArgs, device: torch.device | str | None = None
    ) -> torch.Tensor:
        return precompute_rope_cache(args, device=device)

    def build_norm(self, args: Qwen3ModelArgs) -> nn.Module:
        return build_norm(args.norm_type, args.dim, args.norm_eps)
