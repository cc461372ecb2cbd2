"""Blocks that several families share: truncated-normal init, grouped-query attention with a
fused QKV projection, SwiGLU, the pre-norm transformer block."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from torchtitan.models.common.attention import CausalAttention
from torchtitan.models.common.norms.rmsnorm import build_norm


@torch.no_grad()
def trunc_normal_(weight: torch.Tensor, std: float, clip_stds: float = 3.0) -> None:
    """Normal(0, std) truncated to +-``clip_stds`` std, by inverse-CDF sampling.

    One uniform draw per element (unlike rejection sampling, the RNG use does not depend on the
    values drawn), then the normal quantile via ``erfinv``; only pointwise ops, so it also runs
    on sharded (DTensor) parameters. ``std`` is that of the untruncated normal.
    """
    if weight.is_meta:
        return
    # Sample in float32 at least: erfinv of low-precision uniforms would be coarse in the tails.
    low_precision = weight.dtype in (torch.float16, torch.bfloat16)
    sample = torch.empty_like(weight, dtype=torch.float32) if low_precision else weight
    # Uniform on (Phi(-c), Phi(c)) mapped to (-erf(c/sqrt2), erf(c/sqrt2)) for erfinv.
    bound = math.erf(clip_stds / math.sqrt(2.0))
    sample.uniform_(-bound, bound)
    sample.erfinv_()
    sample.mul_(std * math.sqrt(2.0))
    sample.clamp_(min=-clip_stds * std, max=clip_stds * std)
    if sample is not weight:
        weight.copy_(sample)


def fuse_qkv(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Separate ``wq [H * D, ...]``, ``wk [G * D, ...]``, ``wv [G * D, ...]`` as one ``wqkv``
    whose rows are grouped by kv head: for each of the ``G`` kv heads, its ``H / G`` query heads,
    then its key head, then its value head (Megatron-LM's layout, so that a column-wise split
    into whole groups gives each tensor-parallel rank whole heads of all three). Any trailing
    shape (a weight, or an optimizer moment of one)."""
    head_dim = wk.shape[0] // n_kv_heads
    parts = [w.unflatten(0, (n_kv_heads, -1, head_dim)) for w in (wq, wk, wv)]
    return torch.cat(parts, dim=1).flatten(0, 2)


def split_qkv(
    wqkv: torch.Tensor, n_heads: int, n_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`fuse_qkv`: ``(wq, wk, wv)``."""
    n_rep = n_heads // n_kv_heads
    grouped = wqkv.unflatten(0, (n_kv_heads, n_rep + 2, -1))  # [G, n_rep + 2, D, ...]
    wq, wk, wv = grouped.split((n_rep, 1, 1), dim=1)
    return wq.flatten(0, 2), wk.flatten(0, 2), wv.flatten(0, 2)


def local_part(w: torch.Tensor) -> torch.Tensor:
    """A parameter a module computes with itself, not through ``nn.Linear`` (attention sinks,
    stacked experts): a parallelism may have sharded it (a DTensor), and the module then computes
    on this rank's part (its heads, its experts, its slice of a width) with its inputs' parts;
    a plain tensor as it is."""
    return w.to_local() if isinstance(w, DTensor) else w


Rotary = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query self-attention: one fused projection ``wqkv`` (rows
    as :func:`fuse_qkv` lays them out: one matmul for queries, keys and values), the family's
    rotary embedding ``rotary(xq, xk, rope_cache)``, attention with the kv heads as they are
    (causal, or block-causal under a document ``mask``: see :mod:`.attention`), ``wo``.

    Queries are ``[B, T, G, H / G, D]`` and keys/values ``[B, T, G, 1, D]`` views of the
    projection (``G`` kv heads, position in dim 1) until the rotation makes new tensors. Head
    counts are read from the projected shape, so tensor parallelism may shard ``wqkv``
    column-wise into whole groups (its degree divides ``n_kv_heads``) and ``wo`` row-wise.

    Options (gpt-oss uses the first four; the others none): ``bias`` on ``wqkv`` and ``wo``;
    ``sinks``, a learned logit per query head in each softmax's denominator; ``window``, each
    query sees its last ``window`` keys (itself included); ``scale``, the softmax scale (default
    ``1 / sqrt(head_dim)``). ``gated`` (Qwen3-Next): each query head has an output gate,
    projected with it (``wqkv`` rows per query head: its query, then its gate), and the head's
    output is multiplied by ``sigmoid(gate)`` before ``wo``.
    """

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rotary: Rotary,
        *,
        bias: bool = False,
        sinks: bool = False,
        window: int | None = None,
        scale: float | None = None,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.n_rep = n_heads // n_kv_heads
        self.rotary = rotary
        self.gated = gated
        q_rows = 2 * n_heads if gated else n_heads
        self.wqkv = nn.Linear(dim, (q_rows + 2 * n_kv_heads) * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.window, self.scale = window, scale
        self.sdpa = CausalAttention()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries ``[B, T, G, H / G, D]``, keys and values ``[B, T, G, 1, D]`` (views); with
        ``gated``, the gates ``[B, T, G, H / G, D]`` too, last."""
        q_rows = 2 * self.n_rep if self.gated else self.n_rep
        qkv = self.wqkv(x).unflatten(-1, (-1, q_rows + 2, self.head_dim))
        q, k, v = qkv.split((q_rows, 1, 1), dim=3)
        if not self.gated:
            return q, k, v
        q_gate = q.unflatten(3, (self.n_rep, 2))
        return q_gate[..., 0, :], k, v, q_gate[..., 1, :]

    def attend(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        xv: torch.Tensor,
        mask: Any = None,
        gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over the grouped heads (under the document ``mask``, if any), each head's
        output times ``sigmoid(gate)`` (if given), then ``wo``."""
        bsz, seq_len = xq.shape[:2]
        # [B, T, G, r, D] -> [B, T, G * r, D] -> [B, heads, T, D]
        q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (xq, xk, xv))
        # only what is set: a kernel swapped in by a parallelism need not know the options
        sinks = None if self.sinks is None else local_part(self.sinks)  # [heads] of this rank
        options: dict[str, Any] = {"sinks": sinks, "window": self.window, "scale": self.scale}
        out = self.sdpa(q, k, v, mask, **{n: o for n, o in options.items() if o is not None})
        out = out.transpose(1, 2)  # [B, T, heads, D]
        if gate is not None:
            out = out * torch.sigmoid(gate.flatten(2, 3))
        return self.wo(out.reshape(bsz, seq_len, -1))

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None) -> torch.Tensor:
        xq, xk, xv, *gate = self.project(x)
        xq, xk = self.rotary(xq, xk, rope_cache)
        return self.attend(xq, xk, xv, mask, *gate)

    def init_weights(self, init_std: float) -> None:
        """wqkv and the sinks: truncated normal std 0.02; wo: the given (depth-scaled) std;
        biases zero."""
        trunc_normal_(self.wqkv.weight, std=0.02)
        trunc_normal_(self.wo.weight, std=init_std)
        for bias in (self.wqkv.bias, self.wo.bias):
            if bias is not None:
                nn.init.zeros_(bias)
        if self.sinks is not None:
            trunc_normal_(self.sinks, std=0.02)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1(x)) * w3(x))`` without biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        """w1/w3: truncated normal std 0.02; w2 (output side): the given std."""
        trunc_normal_(self.w1.weight, std=0.02)
        trunc_normal_(self.w3.weight, std=0.02)
        trunc_normal_(self.w2.weight, std=init_std)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``, with the
    family's ``attention`` (called ``attention(x, rope_cache, mask)``, with ``init_weights(std)``) and
    as ``ffn`` a SwiGLU ``feed_forward`` of width ``hidden_dim``, or, when ``args.moe`` (a
    :class:`~torchtitan.models.common.moe.MoEArgs`) makes this layer a mixture-of-experts layer,
    ``moe``. ``args`` gives ``dim``, ``n_layers``, ``norm_type``, ``norm_eps`` and ``depth_init``.

    Output-side projections (wo, w2) start with std ``0.02 / sqrt(2 * (layer_id + 1))``
    (``depth_init``) or ``0.02 / sqrt(2 * n_layers)``; the others 0.02; norms at one.
    """

    def __init__(self, layer_id: int, args: Any, attention: nn.Module, hidden_dim: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_layers = args.n_layers
        self.depth_init = args.depth_init
        zero_centered = getattr(args, "zero_centered_norms", False)
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps, zero_centered)
        self.attention = attention
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps, zero_centered)
        moe_args = getattr(args, "moe", None)
        if moe_args is not None and moe_args.is_moe_layer(layer_id):
            from torchtitan.models.common.moe import MoE  # moe imports this module

            self.moe: nn.Module | None = MoE(args.dim, moe_args)
            self.feed_forward: nn.Module | None = None
        else:
            self.moe, self.feed_forward = None, FeedForward(args.dim, hidden_dim)

    @property
    def ffn(self) -> nn.Module:
        return self.moe if self.moe is not None else self.feed_forward

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache, mask)
        return h + self.ffn(self.ffn_norm(h))

    @property
    def init_std(self) -> float:
        """Std of the output-side projections (wo, w2)."""
        if self.depth_init:
            return 0.02 / math.sqrt(2 * (self.layer_id + 1))
        return 0.02 / math.sqrt(2 * self.n_layers)

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(self.init_std)
        self.ffn.init_weights(self.init_std)
