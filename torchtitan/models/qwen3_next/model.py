"""Qwen3-Next (80B-A3B): model math only, no parallelism.

From ``transformers``' ``modeling_qwen3_next.py`` and the model card; the facts with their sources
are in docs/design/qwen3_next.md.

* Hybrid layers: three Gated DeltaNet layers (linear attention,
  ``models/common/gated_deltanet.py``) for each gated softmax-attention layer (``layer_types``;
  by default layer ``i`` is full attention when ``(i + 1) % full_attention_interval == 0``).
* Gated attention (``GroupedQueryAttention(gated=True)``): each query head projected with an
  output gate, QK-norm over ``head_dim``, rotary embeddings on the first quarter of each head
  (``partial_rotary_factor``, half-split layout), the head's output times ``sigmoid(gate)``.
* Every norm (the blocks', the QK norms, the final one) is zero-centered: scale ``1 + weight``,
  ``weight`` starting at zero; the DeltaNet's gated output norm is not (scale ``weight``, from one).
* Every feed-forward a mixture of experts: softmax router over all experts, top-k renormalized,
  512 experts of width 512 with top-10, plus a shared expert of width 512 whose output is scaled
  by ``sigmoid`` of a linear of the token. (Qwen3.5's dense sizes, ``models/qwen3_5``: ``moe``
  None, every feed-forward a SwiGLU of width ``hidden_dim``.)
* Untied output head, no embedding scale, RMSNorm eps 1e-6.

The published checkpoint also holds a multi-token-prediction depth (``mtp.*``, a gated
softmax-attention MoE block; ``transformers`` does not load it): ``num_mtp_layers`` 1 builds it
(``models/common/mtp.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from torchtitan.models.common import rope
from torchtitan.models.common.blocks import GroupedQueryAttention, TransformerBlock
from torchtitan.models.common.decoder import (
    Decoder,
    attention_flops,
    check_decoder_args,
    check_layer_types,
)
from torchtitan.models.common.gated_deltanet import GatedDeltaNet, delta_rule_flops
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.mtp import MTPLayer
from torchtitan.models.common.norms.rmsnorm import build_norm

__all__ = [
    "LAYER_TYPES",
    "HybridMask",
    "Qwen3NextModel",
    "Qwen3NextModelArgs",
    "default_layer_types",
    "qwen3_next_moe",
]

LAYER_TYPES = ("linear_attention", "full_attention")


def default_layer_types(n_layers: int, interval: int) -> tuple[str, ...]:
    """Layer ``i`` is full attention when ``(i + 1) % interval == 0`` (``transformers``' rule for
    ``full_attention_interval``), linear attention otherwise."""
    return tuple(LAYER_TYPES[(i + 1) % interval == 0] for i in range(n_layers))


def qwen3_next_moe(num_experts: int, top_k: int, hidden_dim: int, shared_dim: int) -> MoEArgs:
    """Qwen3-Next's MoE layer: softmax router, top-k renormalized, a gated shared expert."""
    return MoEArgs(
        num_experts=num_experts,
        top_k=top_k,
        hidden_dim=hidden_dim,
        score_func="softmax",
        route_norm=True,
        shared_hidden_dim=shared_dim,
        shared_gate=True,
    )


@dataclass
class Qwen3NextModelArgs:
    """Hyper-parameters of one Qwen3-Next flavor (``config.json`` name in brackets)."""

    dim: int = 2048  # hidden_size
    n_layers: int = 48  # num_hidden_layers
    n_heads: int = 16  # num_attention_heads
    n_kv_heads: int | None = 2  # num_key_value_heads; None: same as n_heads
    head_dim: int = 256  # head_dim
    partial_rotary_factor: float = 0.25  # the rotated share of each head
    hidden_dim: int = 5120  # intermediate_size: a dense feed-forward's width (when moe is None)
    vocab_size: int = -1  # vocab_size; -1: set from the tokenizer at build time
    tokenizer_vocab_size: int | None = field(default=None, compare=False)
    norm_eps: float = 1e-6  # rms_norm_eps (every norm, the DeltaNet's gated one included)
    rope_theta: float = 10_000_000.0  # rope_theta
    max_seq_len: int = 262144  # max_position_embeddings: the rotary table's length
    # layer_types: "linear_attention" or "full_attention" per layer; None: from
    # full_attention_interval (and for any n_layers)
    layer_types: tuple[str, ...] | None = None
    full_attention_interval: int = 4
    # Gated DeltaNet [linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    # linear_value_head_dim, linear_conv_kernel_dim]
    linear_n_key_heads: int = 16
    linear_n_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    # positions the chunked delta rule takes at once (how it computes, not the model)
    linear_chunk_size: int = field(default=64, compare=False)
    tie_word_embeddings: bool = False  # tie_word_embeddings
    # multi-token-prediction depths (models/common/mtp.py), each a gated softmax-attention MoE
    # block; the published checkpoint holds one (mtp.*), which transformers does not load
    num_mtp_layers: int = 0
    depth_init: bool = True  # scale the output projections' init by the layer's depth
    norm_type: str = "rmsnorm"
    zero_centered_norms: bool = field(default=True, init=False)  # the architecture's, always
    # "causal" or "block_causal" (how a run trains: not in config.json, not compared)
    attn_mask_type: str = field(default="causal", compare=False)
    # the feed-forwards' experts; None: every feed-forward dense, of width hidden_dim (the
    # Qwen3.5 dense sizes, models/qwen3_5)
    moe: MoEArgs | None = field(default_factory=lambda: qwen3_next_moe(512, 10, 512, 512))

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_decoder_args(self)
        self.layer_types = check_layer_types(self.layer_types, self.n_layers, LAYER_TYPES)
        if self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers ({self.num_mtp_layers}) must be >= 0")
        rotary = self.rotary_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor ({self.partial_rotary_factor}) x head_dim "
                f"({self.head_dim}) must be an even number of channels in 2..head_dim"
            )
        if self.linear_n_value_heads % self.linear_n_key_heads:
            raise ValueError(
                f"linear_n_value_heads ({self.linear_n_value_heads}) must be a multiple of "
                f"linear_n_key_heads ({self.linear_n_key_heads})"
            )

    @property
    def rotary_dim(self) -> int:
        """The rotated channels of each head."""
        return int(self.head_dim * self.partial_rotary_factor)

    def kinds(self) -> tuple[str, ...]:
        """Each layer's token mixer: ``layer_types``, or the interval's pattern."""
        if self.layer_types is not None:
            return self.layer_types
        return default_layer_types(self.n_layers, self.full_attention_interval)

    def ffn_hidden_dim(self) -> int:
        """The width tensor parallelism splits: every expert's, or the dense feed-forward's."""
        return self.moe.hidden_dim if self.moe is not None else self.hidden_dim

    def tensor_parallel_sizes(self) -> tuple[tuple[str, int], ...]:
        """What tensor parallelism splits beyond the decoder's sizes: whole key-head groups of
        the linear layers."""
        return (("linear_n_key_heads", self.linear_n_key_heads),)

    def context_parallel_reach(self) -> int:
        """The positions before a chunk its first ones read: the convolution's ``K - 1``."""
        return self.linear_conv_kernel - 1

    def mixer_flops(self, seq_len: int) -> list[float]:
        """Each layer's training FLOPs per token beyond its parameters': causal attention's
        over the sequence (``attention_flops``), or the delta rule's (``delta_rule_flops``: the
        same at any length)."""
        linear = delta_rule_flops(
            self.linear_n_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
            self.linear_chunk_size,
        )
        full = attention_flops(self.n_heads * self.head_dim, seq_len)
        return [linear if kind == LAYER_TYPES[0] else full for kind in self.kinds()]


class HybridMask(NamedTuple):
    """What a hybrid model's blocks take as ``mask``: the softmax layers' (None: causal) and the
    batch's document ids for the linear layers (None: one sequence per row)."""

    attention: Any
    doc_ids: torch.Tensor | None


class GatedAttention(GroupedQueryAttention):
    """Qwen3-Next's softmax attention: gated, QK-norm (zero-centered, over ``head_dim``), rotary
    embeddings on the first ``rotary_dim`` channels of each head."""

    def __init__(self, args: Qwen3NextModelArgs) -> None:
        assert args.n_kv_heads is not None
        super().__init__(
            args.dim,
            args.n_heads,
            args.n_kv_heads,
            args.head_dim,
            rope.apply_partial_half_split,
            gated=True,
        )
        self.q_norm = build_norm(args.norm_type, args.head_dim, args.norm_eps, zero_centered=True)
        self.k_norm = build_norm(args.norm_type, args.head_dim, args.norm_eps, zero_centered=True)

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None) -> torch.Tensor:
        xq, xk, xv, gate = self.project(x)
        xq, xk = self.rotary(self.q_norm(xq), self.k_norm(xk), rope_cache)
        return self.attend(xq, xk, xv, _part(mask, "attention"), gate)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()


class LinearAttention(GatedDeltaNet):
    """:class:`GatedDeltaNet` as a block's ``attention`` (``forward(x, rope_cache, mask)``: no
    rotary embeddings; the documents from the mask)."""

    def __init__(self, args: Qwen3NextModelArgs) -> None:
        super().__init__(
            args.dim,
            args.linear_n_key_heads,
            args.linear_n_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
            conv_kernel=args.linear_conv_kernel,
            norm_eps=args.norm_eps,
            chunk_size=args.linear_chunk_size,
        )

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None
    ) -> torch.Tensor:
        return super().forward(x, _part(mask, "doc_ids"))


def _part(mask: Any, name: str) -> Any:
    return getattr(mask, name) if isinstance(mask, HybridMask) else None


class Qwen3NextModel(Decoder):
    """Qwen3-Next decoder: token embedding, ``n_layers`` MoE blocks whose token mixer is linear
    or gated softmax attention, final zero-centered RMSNorm, untied output head; the skeleton and
    init of :class:`~torchtitan.models.common.decoder.Decoder`."""

    def build_block(self, layer_id: int, args: Qwen3NextModelArgs) -> nn.Module:
        kind = args.kinds()[layer_id]
        mixer = LinearAttention(args) if kind == LAYER_TYPES[0] else GatedAttention(args)
        return TransformerBlock(layer_id, args, mixer, args.hidden_dim)

    def build_mtp_layer(self, layer_id: int, args: Qwen3NextModelArgs) -> nn.Module:
        """A prediction depth around a gated softmax-attention MoE block (as published), its
        norms zero-centered."""
        block = TransformerBlock(layer_id, args, GatedAttention(args), args.hidden_dim)
        return MTPLayer(args.dim, block, lambda: self.build_norm(args))

    def build_rope_cache(
        self, args: Qwen3NextModelArgs, device: torch.device | str | None = None
    ) -> torch.Tensor:
        freqs = rope.inv_freqs(args.rotary_dim, args.rope_theta, device)
        return rope.half_split_table(rope.angles(freqs, args.max_seq_len))

    def build_norm(self, args: Qwen3NextModelArgs) -> nn.Module:
        return build_norm(args.norm_type, args.dim, args.norm_eps, zero_centered=True)

    def attention_mask(self, doc_ids: torch.Tensor | None) -> Any:
        """The softmax layers' mask (the decoder's) and, with ``block_causal``, the document ids
        the linear layers reset their state at."""
        block_causal = doc_ids is not None and self.args.attn_mask_type == "block_causal"
        return HybridMask(super().attention_mask(doc_ids), doc_ids if block_causal else None)
