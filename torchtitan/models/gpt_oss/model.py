"""gpt-oss (OpenAI, 20B and 120B): model math only, no parallelism.

From ``transformers``' ``modeling_gpt_oss.py``, OpenAI's reference ``gpt_oss/torch/model.py`` and
the model card (arXiv:2508.10925); the facts with their sources are in docs/design/gpt_oss.md.

* Pre-norm decoder blocks, every feed-forward a mixture of experts (``models/common/moe.py``):
  a router with a bias, softmax over the top-k logits (= softmax, top-k, renormalized), experts
  with biases and the clamped SwiGLU ``min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)``.
* Attention (``GroupedQueryAttention``): biases on the q/k/v/o projections, a learned sink logit
  per query head in each softmax's denominator, and on every other layer (``layer_types``;
  the even ones in the published models) a sliding window of ``sliding_window`` keys, the
  query's own included. ``head_dim`` is its own (64), not ``dim / n_heads``.
* Rotary embeddings in the half-split layout with YaRN at every length (factor 32 over 4096
  positions, ``beta_fast`` 32, ``beta_slow`` 1, the ramp not truncated). ``transformers``
  multiplies cos and sin by YaRN's attention factor ``0.1 ln(32) + 1``; here its square
  multiplies the softmax scale instead: the same scores, the sinks compared with them unscaled.
* RMSNorm eps 1e-5, untied output head, no embedding scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from torchtitan.models.common import rope
from torchtitan.models.common.blocks import GroupedQueryAttention, TransformerBlock
from torchtitan.models.common.decoder import Decoder, check_decoder_args, check_layer_types
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.norms.rmsnorm import build_norm

__all__ = ["GptOssModelArgs", "GptOssModel", "LAYER_TYPES", "default_layer_types", "gpt_oss_moe"]

LAYER_TYPES = ("sliding_attention", "full_attention")


def default_layer_types(n_layers: int) -> tuple[str, ...]:
    """Sliding on the even layers, full on the odd ones (``transformers``' default, and every
    published gpt-oss)."""
    return tuple(LAYER_TYPES[i % 2] for i in range(n_layers))


def gpt_oss_moe(num_experts: int, top_k: int, hidden_dim: int) -> MoEArgs:
    """gpt-oss's MoE layer: biased router, softmax over the top-k, biased clamped-SwiGLU experts."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden_dim,
        score_func="softmax",
        route_norm=True,
        gate_bias=True,
        expert_linear_bias=True,
        activation="clamped_swiglu",
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
    )


@dataclass
class GptOssModelArgs:
    """Hyper-parameters of one gpt-oss flavor (``config.json`` name in brackets)."""

    dim: int = 2880  # hidden_size
    n_layers: int = 24  # num_hidden_layers
    n_heads: int = 64  # num_attention_heads
    n_kv_heads: int | None = 8  # num_key_value_heads; None: same as n_heads
    head_dim: int = 64  # head_dim
    vocab_size: int = -1  # vocab_size; -1: set from the tokenizer at build time
    # the tokens of the flavor's own tokenizer when the embedding table is padded beyond them
    tokenizer_vocab_size: int | None = field(default=None, compare=False)
    norm_eps: float = 1e-5  # rms_norm_eps
    rope_theta: float = 150_000.0  # rope_theta
    # YaRN [rope_scaling: factor, original_max_position_embeddings, beta_fast, beta_slow, truncate]
    rope_factor: float = 32.0
    rope_original_max_seq_len: int = 4096
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_truncate: bool = False
    max_seq_len: int = 131072  # max_position_embeddings: the rotary table's length
    sliding_window: int = 128  # sliding_window: keys a sliding layer's query sees, itself included
    # layer_types: "sliding_attention" or "full_attention" per layer; None: sliding on the even
    # layers (0, 2, ...) and full on the odd ones, as published (and for any n_layers)
    layer_types: tuple[str, ...] | None = None
    tie_word_embeddings: bool = False  # tie_word_embeddings
    depth_init: bool = True  # scale wo/w2 init by the layer's depth rather than by n_layers
    norm_type: str = "rmsnorm"
    # "causal" or "block_causal" (how a run trains: not in config.json, not compared)
    attn_mask_type: str = field(default="causal", compare=False)
    moe: MoEArgs = field(default_factory=lambda: gpt_oss_moe(32, 4, 2880))

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_decoder_args(self)
        self.layer_types = check_layer_types(self.layer_types, self.n_layers, LAYER_TYPES)
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window ({self.sliding_window}) must be at least 1")

    @property
    def hidden_dim(self) -> int:
        """Each expert's width (every layer is an MoE layer)."""
        return self.moe.hidden_dim

    def ffn_hidden_dim(self) -> int:
        """The width tensor parallelism splits: every expert's."""
        return self.moe.hidden_dim

    def kinds(self) -> tuple[str, ...]:
        """Each layer's attention kind: ``layer_types``, or the published alternation."""
        if self.layer_types is not None:
            return self.layer_types
        return default_layer_types(self.n_layers)

    def attention_windows(self) -> list[int | None]:
        """Each layer's window (None: full causal attention)."""
        return [self.sliding_window if t == LAYER_TYPES[0] else None for t in self.kinds()]

    def softmax_scale(self) -> float:
        """``head_dim ** -0.5`` times the square of YaRN's attention factor."""
        return self.head_dim**-0.5 * rope.yarn_mscale(self.rope_factor) ** 2


def precompute_rope_cache(
    args: GptOssModelArgs, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[max_seq_len, 2, head_dim]`` float32: YaRN frequencies, half-split layout."""
    freqs = rope.yarn_inv_freqs(
        args.head_dim,
        args.rope_theta,
        args.rope_factor,
        args.rope_original_max_seq_len,
        beta_fast=args.rope_beta_fast,
        beta_slow=args.rope_beta_slow,
        truncate=args.rope_truncate,
    )
    return rope.half_split_table(rope.angles(freqs.to(device), args.max_seq_len))


class GptOssModel(Decoder):
    """gpt-oss decoder: token embedding, ``n_layers`` MoE blocks (attention with sinks, the
    sliding ones windowed), final RMSNorm, untied output head; the skeleton and init of
    :class:`~torchtitan.models.common.decoder.Decoder`.

    Weight init: wqkv, the sinks, the router (weight and bias), w1/w3 truncated normal std 0.02;
    wo and w2 depth-scaled; the projections' and experts' biases zero; norms one.
    """

    def build_block(self, layer_id: int, args: GptOssModelArgs) -> nn.Module:
        assert args.n_kv_heads is not None
        attention = GroupedQueryAttention(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            rope.apply_half_split,
            bias=True,
            sinks=True,
            window=args.attention_windows()[layer_id],
            scale=args.softmax_scale(),
        )
        return TransformerBlock(layer_id, args, attention, args.moe.hidden_dim)

    def build_rope_cache(
        self, args: GptOssModelArgs, device: torch.device | str | None = None
    ) -> torch.Tensor:
        return precompute_rope_cache(args, device=device)

    def build_norm(self, args: GptOssModelArgs) -> nn.Module:
        return build_norm(args.norm_type, args.dim, args.norm_eps)
