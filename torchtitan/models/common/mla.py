"""Multi-head latent attention (MLA), DeepSeek-V2/V3's attention.

Keys and values come from one compressed latent per position: ``wkv_a`` projects the input to
``kv_lora_rank`` latent channels (normalized by ``kv_norm``) plus ``qk_rope_head_dim`` channels
of a rotary key shared by every head; ``wkv_b`` expands the latent into each head's
``qk_nope_head_dim`` key channels and ``v_head_dim`` value channels. Queries come from ``wq``, or
from a low-rank pair ``wq_a`` -> ``q_norm`` -> ``wq_b`` when ``q_lora_rank`` > 0; each head's
last ``qk_rope_head_dim`` channels are rotated, the rest are not. A head attends with
``qk_nope_head_dim + qk_rope_head_dim`` query/key channels and ``v_head_dim`` value channels.

The rotary channels are rotated as interleaved pairs (:func:`.rope.apply_interleaved`), the
layout of DeepSeek's published weights (``transformers``' ``rope_interleave``), so they load
without a permutation. ``softmax_scale`` defaults to ``1 / sqrt(qk head dim)``; under YaRN the
published models multiply it by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.models.common.attention import CausalAttention
from torchtitan.models.common.blocks import trunc_normal_
from torchtitan.models.common.norms.rmsnorm import build_norm
from torchtitan.models.common.rope import apply_interleaved


class MultiLatentAttention(nn.Module):
    """MLA over ``x [B, T, dim]`` with the rotation table of ``qk_rope_head_dim`` channels."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        softmax_scale: float | None = None,
        norm_type: str = "rmsnorm",
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = n_heads, q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = qk_nope_head_dim, qk_rope_head_dim
        self.v_head_dim = v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.softmax_scale = softmax_scale if softmax_scale is not None else qk_head_dim**-0.5
        if q_lora_rank == 0:
            self.wq = nn.Linear(dim, n_heads * qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = build_norm(norm_type, q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = build_norm(norm_type, kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)
        self.sdpa = CausalAttention()

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, H, qk head dim]``, heads read from the projection (tensor parallel may
        shard it column-wise by head)."""
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        return q.unflatten(-1, (-1, self.qk_nope_head_dim + self.qk_rope_head_dim))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None) -> torch.Tensor:
        bsz, seq_len = x.shape[:2]
        q_nope, q_rope = self.queries(x).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        # the shared rotary key as one head [B, T, 1, R], rotated with every head's queries
        q_rope, k_rope = apply_interleaved(q_rope, k_rope.unsqueeze(2), rope_cache)
        kv = self.wkv_b(self.kv_norm(latent)).unflatten(
            -1, (-1, self.qk_nope_head_dim + self.v_head_dim)
        )
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], -1)
        q = torch.cat([q_nope, q_rope], -1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)], -1)
        # [B, T, H, D] -> [B, H, T, D]
        out = self.sdpa(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.softmax_scale
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))

    def init_weights(self, init_std: float) -> None:
        """Projections into the attention: truncated normal std 0.02; ``wo`` the given
        (depth-scaled) std; the norms ones."""
        inputs = [self.wkv_a, self.wkv_b]
        inputs += [self.wq] if self.q_lora_rank == 0 else [self.wq_a, self.wq_b]
        for linear in inputs:
            trunc_normal_(linear.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        for norm in [self.kv_norm] + ([] if self.q_lora_rank == 0 else [self.q_norm]):
            norm.reset_parameters()
