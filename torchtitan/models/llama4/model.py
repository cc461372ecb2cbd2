"""Llama 4 (text): a mixture-of-experts decoder. Model math only, no parallelism.

From ``transformers``' ``modeling_llama4.py`` (the text model, ``Llama4ForCausalLM``) and Meta's
Llama 4 model card:

* **MoE feed-forward** (``models/common/moe.py``): a sigmoid router choosing the top-1 of 16
  (Scout) or 128 (Maverick) routed experts, whose *input* is scaled by the router's score
  (``score_before_experts``), plus one shared expert of the same width on every MoE layer.
  Maverick alternates dense and MoE layers (``interleave_moe_layer_step`` 2; the dense ones
  are a SwiGLU of ``intermediate_size_mlp``), Scout has MoE on every layer.
* **iRoPE**: every 4th layer (``(i + 1) % 4 == 0``) has no rotary embedding ("NoPE") and attends
  over the whole causal context; the others rotate queries and keys (Meta's interleaved complex
  pairs, as Llama 3, with Llama 3.1-style frequency scaling where published) and attend within
  chunks of ``attention_chunk_size`` tokens (8192): position ``i`` sees ``j <= i`` of the same
  chunk.
* **QK-norm** (Scout; not Maverick): after the rotation, queries and keys of the rotary layers
  are divided by their root mean square (no learned scale; eps ``rms_norm_eps``).
* **Attention temperature tuning** on the NoPE layers: queries at position ``p`` are scaled by
  ``1 + attn_scale * log(1 + floor((p + 1) / floor_scale))`` (1 below position 8191).

The rotary table carries, per position, the rotation pairs plus a last pair (position, query
temperature), so that context parallelism's cut of the table (the rows of the positions a rank
holds) gives the chunked layers and the temperature their positions too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchtitan.models.common import rope
from torchtitan.models.common.blocks import GroupedQueryAttention, TransformerBlock
from torchtitan.models.common.decoder import Decoder, check_decoder_args
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.common.norms.rmsnorm import build_norm
from torchtitan.models.llama.model import apply_rotary_emb, rope_inv_freqs

__all__ = ["Llama4ModelArgs", "Llama4Attention", "Llama4Model"]


@dataclass
class Llama4ModelArgs:
    """Hyper-parameters of one Llama 4 flavor (``transformers``' ``Llama4TextConfig`` names in
    brackets)."""

    dim: int = 5120  # hidden_size
    n_layers: int = 48  # num_hidden_layers
    n_heads: int = 40  # num_attention_heads
    n_kv_heads: int | None = 8  # num_key_value_heads
    head_dim: int = 128  # head_dim
    hidden_dim: int = 16384  # intermediate_size_mlp: the dense layers' SwiGLU width
    vocab_size: int = -1  # vocab_size; -1: set from the tokenizer at build time
    norm_eps: float = 1e-5  # rms_norm_eps (the QK norm's eps too)
    rope_theta: float = 500_000.0  # rope_theta
    # Llama 3.1-style rotary frequency scaling (rope_scaling of type "llama3")
    use_scaled_rope: bool = False
    rope_scale_factor: float = 16.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 1.0
    rope_original_max_seq_len: int = 8192
    max_seq_len: int = 8192  # length of the precomputed rotary table
    nope_layer_interval: int = 4  # no_rope_layer_interval: layer i is NoPE when (i+1) % it == 0
    attention_chunk_size: int | None = 8192  # rotary layers attend within chunks of this
    use_qk_norm: bool = True  # use_qk_norm
    attn_temperature_tuning: bool = True  # attn_temperature_tuning
    floor_scale: int = 8192  # floor_scale
    attn_scale: float = 0.1  # attn_scale
    tie_word_embeddings: bool = False
    depth_init: bool = True  # scale wo/w2 init by the layer's depth rather than by n_layers
    norm_type: str = "rmsnorm"
    # how a run trains, not an architecture setting (not in config.json, not compared)
    attn_mask_type: str = field(default="causal", compare=False)
    moe: MoEArgs = field(
        default_factory=lambda: MoEArgs(
            num_experts=16,
            top_k=1,
            hidden_dim=8192,
            score_func="sigmoid",
            score_before_experts=True,
            shared_hidden_dim=8192,
        )
    )

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        check_decoder_args(self)

    def uses_rope(self, layer_id: int) -> bool:
        interval = self.nope_layer_interval
        return not interval or (layer_id + 1) % interval != 0

    def ffn_hidden_dim(self) -> int:
        """The width tensor parallelism splits in every layer (experts and shared expert)."""
        return self.moe.hidden_dim


def precompute_rope_cache(
    args: Llama4ModelArgs, device: torch.device | str | None = None
) -> torch.Tensor:
    """``[max_seq_len, head_dim // 2 + 1, 2]`` float32: per position the (cos, sin) of each
    rotated pair (Meta's interleaved layout, as Llama's table), then (position, query
    temperature of the NoPE layers)."""
    freqs = rope_inv_freqs(args, device=device)  # float64, with the 3.1 scaling if any
    positions = torch.arange(args.max_seq_len, dtype=torch.float64, device=device)
    theta = rope.angles(freqs, args.max_seq_len)
    rotation = rope.interleaved_table(theta)  # float32, as Llama's table
    temperature = 1.0 + args.attn_scale * torch.log1p(
        torch.floor((positions + 1) / args.floor_scale)
    )
    extra = torch.stack((positions, temperature), dim=-1).unsqueeze(1)
    return torch.cat((rotation, extra.to(torch.float32)), dim=1)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` over its root mean square (float32 inside, no learned scale)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class Llama4Attention(GroupedQueryAttention):
    """Grouped-query attention of layer ``layer_id``: rotary, QK-norm and chunked (the rotary
    layers) or temperature-tuned over the whole context (NoPE layers). ``mask`` is
    :meth:`Llama4Model.attention_mask`'s ``(document mask or None, document ids or None)``."""

    def __init__(self, layer_id: int, args: Llama4ModelArgs) -> None:
        assert args.n_kv_heads is not None
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.head_dim, apply_rotary_emb)
        self.use_rope = args.uses_rope(layer_id)
        self.qk_norm_eps = args.norm_eps if args.use_qk_norm and self.use_rope else None
        self.temperature = args.attn_temperature_tuning and not self.use_rope
        chunk = args.attention_chunk_size
        # chunks matter only when a sequence can be longer than one (the table: training seq_len)
        self.chunk = chunk if self.use_rope and chunk and chunk < args.max_seq_len else None

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None) -> torch.Tensor:
        full_mask, doc_ids = mask if mask is not None else (None, None)
        table = rope_cache[: x.shape[1]]  # the rows of this rank's positions
        xq, xk, xv = self.project(x)
        if self.use_rope:
            # contiguous: torch.compile's backward of a complex view of the strided slice is wrong
            # (wqkv gradients off by 6-70% on CPU, torch 2.13); the copy is [T, head_dim] floats
            xq, xk = self.rotary(xq, xk, table[:, :-1].contiguous())
            if self.qk_norm_eps is not None:
                xq, xk = _rms(xq, self.qk_norm_eps), _rms(xk, self.qk_norm_eps)
        elif self.temperature:
            scale = table[:, -1, 1].view(1, -1, *(1,) * (xq.ndim - 2))
            xq = (xq * scale).to(xq.dtype)
        if self.chunk is None:
            return self.attend(xq, xk, xv, full_mask)
        # within chunks (and documents): ids that change at every chunk and document start
        chunk_ids = (table[:, -1, 0] // self.chunk).to(torch.int32).expand(x.shape[0], -1)
        ids = chunk_ids if doc_ids is None else chunk_ids + doc_ids.to(torch.int32)
        return self.attend(xq, xk, xv, self.sdpa.mask_for(ids))


class Llama4Model(Decoder):
    """Llama 4 text decoder: token embedding, ``n_layers`` blocks (MoE feed-forward on the MoE
    layers, see :class:`~torchtitan.models.common.blocks.TransformerBlock`), final RMSNorm,
    output projection. Init as Llama's; the experts like its SwiGLU, the router std 0.02."""

    def build_block(self, layer_id: int, args: Llama4ModelArgs) -> nn.Module:
        return TransformerBlock(layer_id, args, Llama4Attention(layer_id, args), args.hidden_dim)

    def build_rope_cache(
        self, args: Llama4ModelArgs, device: torch.device | str | None = None
    ) -> torch.Tensor:
        return precompute_rope_cache(args, device=device)

    def build_norm(self, args: Llama4ModelArgs) -> nn.Module:
        return build_norm(args.norm_type, args.dim, args.norm_eps)

    def attention_mask(self, doc_ids: torch.Tensor | None) -> Any:
        """``(the document mask of the NoPE layers or None, the document ids the chunked layers
        combine with their chunks, or None)``."""
        docs = doc_ids if self.args.attn_mask_type == "block_causal" else None
        return super().attention_mask(doc_ids), docs
