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

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.norms import NORM_TYPES, RMSNorm, build_norm

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
    # RMSNorm implementation (same math and parameter, see torchtitan/models/norms.py)
    norm_type: str = "rmsnorm"

    def __post_init__(self) -> None:
        if self.norm_type not in NORM_TYPES:
            raise ValueError(f"norm_type {self.norm_type!r} is not one of: {', '.join(NORM_TYPES)}")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

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
    """Rotation frequencies (radians per position), shape ``[head_dim // 2]``, float64.

    Pair ``i`` rotates at ``rope_theta ** (-2i / head_dim)``. With ``use_scaled_rope`` the
    Llama 3.1 rule applies: components whose wavelength is shorter than
    ``original_max_seq_len / high_freq_factor`` are unchanged, those longer than
    ``original_max_seq_len / low_freq_factor`` are divided by ``rope_scale_factor``, and the band
    in between interpolates smoothly (in wavelength-ratio space) between the two.
    """
    head_dim = args.head_dim
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    freqs = 1.0 / (args.rope_theta**exponents)
    if not args.use_scaled_rope:
        return freqs

    old_len = float(args.rope_original_max_seq_len)
    low, high, factor = (
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_scale_factor,
    )
    wavelen = 2 * math.pi / freqs
    # smooth = 1 keeps a frequency, smooth = 0 divides it by the factor.
    smooth = (old_len / wavelen - low) / (high - low)
    smooth = smooth.clamp(0.0, 1.0)
    return (1.0 - smooth) * freqs / factor + smooth * freqs


def precompute_rope_cache(
    args: ModelArgs, device: torch.device | str | None = None
) -> torch.Tensor:
    """Cos/sin table ``[max_seq_len, head_dim // 2, 2]`` (float32) for positions 0..max_seq_len-1.

    Angles are computed in float64 so long contexts keep their precision, then stored as float32.
    """
    freqs = rope_inv_freqs(args, device=device)
    positions = torch.arange(args.max_seq_len, dtype=torch.float64, device=device)
    angles = torch.outer(positions, freqs)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).to(torch.float32)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, rope_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate queries and keys ``[B, T, heads, head_dim]`` by their position (0..T-1).

    Adjacent channels ``(2i, 2i+1)`` form the complex pair rotated at frequency ``i`` (Meta's
    layout). The rotation runs in float32 and the result keeps the input dtype.
    """
    seq_len = xq.shape[1]
    cache = rope_cache[:seq_len]
    cos = cache[..., 0].unsqueeze(0).unsqueeze(2)  # [1, T, 1, head_dim // 2]
    sin = cache[..., 1].unsqueeze(0).unsqueeze(2)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().unflatten(-1, (-1, 2))
        even, odd = pairs[..., 0], pairs[..., 1]
        out = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return out.flatten(-2).type_as(x)

    return rotate(xq), rotate(xk)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def _trunc_normal_(weight: torch.Tensor, std: float, clip_stds: float = 3.0) -> None:
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


class CausalAttention(nn.Module):
    """Causal scaled dot-product attention: queries ``[B, H, T, D]``, keys and values
    ``[B, H_kv, T, D]`` -> ``[B, H, T, D]``.

    Each kv head serves ``H / H_kv`` consecutive query heads (Meta's ``repeat_kv`` convention).
    A module of its own so that a parallelism can put another implementation of the same math in
    its place (context parallel swaps in one that gathers keys and values across ranks).
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings (no biases, no dropout).

    Head counts are read from the projected shapes in ``forward``, so tensor parallelism may
    shard ``wq``/``wk``/``wv`` column-wise and ``wo`` row-wise without changes here.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.n_kv_heads is not None
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.sdpa = CausalAttention()

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        xq = self.wq(x).view(bsz, seq_len, -1, self.head_dim)
        xk = self.wk(x).view(bsz, seq_len, -1, self.head_dim)
        xv = self.wv(x).view(bsz, seq_len, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache)

        # [B, T, H, D] -> [B, H, T, D]
        out = self.sdpa(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2))
        out = out.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.wo(out)

    def init_weights(self, init_std: float) -> None:
        """wq/wk/wv: truncated normal std 0.02; wo: the given (depth-scaled) std."""
        for linear in (self.wq, self.wk, self.wv):
            _trunc_normal_(linear.weight, std=0.02)
        _trunc_normal_(self.wo.weight, std=init_std)


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
        _trunc_normal_(self.w1.weight, std=0.02)
        _trunc_normal_(self.w3.weight, std=0.02)
        _trunc_normal_(self.w2.weight, std=init_std)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_layers = args.n_layers
        self.depth_init = args.depth_init
        self.attention_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim())

    def forward(self, x: torch.Tensor, rope_cache: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cache)
        return h + self.feed_forward(self.ffn_norm(h))

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
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    """Llama decoder: token embedding, ``n_layers`` blocks, final RMSNorm, output projection.

    ``forward(tokens [B, T] int64) -> logits [B, T, vocab] float32``. ``layers`` is an
    ``nn.ModuleDict`` keyed ``"0"``..``"n-1"`` so pipeline stages can drop layers and keep the
    original names (checkpoint keys stay stable).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        if args.vocab_size <= 0:
            raise ValueError(
                f"ModelArgs.vocab_size is {args.vocab_size}; set it from the tokenizer "
                "(tokenizer.n_words) before building the model"
            )
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers

        self.tok_embeddings: nn.Embedding | None = nn.Embedding(args.vocab_size, args.dim)
        # Non-persistent: recomputed by init_weights, never stored in checkpoints.
        self.register_buffer("rope_cache", precompute_rope_cache(args), persistent=False)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args) for i in range(args.n_layers)}
        )
        self.norm: RMSNorm | None = build_norm(args.norm_type, args.dim, args.norm_eps)
        self.output: nn.Linear | None = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _retie(self) -> None:
        if (
            self.args.tie_word_embeddings
            and self.tok_embeddings is not None
            and self.output is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Module._apply (to_empty from meta in particular) may replace each module's Parameter
        # with a new object, which would silently untie the embedding and output weights.
        result = super()._apply(fn, *args, **kwargs)
        self._retie()
        return result

    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)compute the rotary table and initialize every parameter in place.

        Deterministic given torch's RNG state: embeddings ~ N(0, 1); wq/wk/wv/w1/w3 truncated
        normal std 0.02; wo/w2 std ``0.02 / sqrt(2 * (layer_id + 1))`` (``depth_init``) or
        ``0.02 / sqrt(2 * n_layers)``; norms to one; output truncated normal std ``dim ** -0.5``.
        Every truncated normal is cut at 3 std (inverse-CDF sampling, see ``_trunc_normal_``).

        With tied embeddings the one shared matrix is truncated normal std 0.02 (the
        ``initializer_range`` of Llama 3.2's config.json): unit-variance rows would make the
        logits ~dim large at init, and even std ``dim ** -0.5`` lets each position's own token
        embedding dominate its logits (initial loss far above ln(vocab)).

        The table goes to ``buffer_device`` (default: where the buffer already is, i.e. the
        ``to_empty`` device).
        """
        device = buffer_device if buffer_device is not None else self.rope_cache.device
        with torch.no_grad():
            self.rope_cache = precompute_rope_cache(self.args, device=device)
        self._retie()
        tied = self.args.tie_word_embeddings
        if self.tok_embeddings is not None:
            if tied:
                _trunc_normal_(self.tok_embeddings.weight, std=0.02)
            else:
                nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            if not tied:
                _trunc_normal_(self.output.weight, std=self.args.dim**-0.5, clip_stds=3.0)
            elif self.tok_embeddings is None:
                # a pipeline stage holding only the (tied) output: same scheme as the embedding
                _trunc_normal_(self.output.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position; stages without embeddings take hidden states instead."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope_cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            return self.output(h).float()
        return h


def get_nparams_and_flops(model: nn.Module, args: ModelArgs, seq_len: int) -> tuple[int, int]:
    """Parameter count and training FLOPs per token; works on meta-device models.

    * Parameters: every distinct parameter once (tied embedding/output weights count once).
    * FLOPs per token ``= 6 * N + 6 * n_layers * dim * seq_len`` where

      - ``N`` is the number of parameters used in matmuls: everything except the input embedding
        table (a lookup), with the output projection counted even when tied to the embedding
        (it is a real ``dim x vocab`` matmul). RMSNorm scales are negligible and included.
        ``6 = 2`` (multiply-add) ``x 3`` (forward, grad wrt input, grad wrt weight).
      - the attention term covers ``Q K^T`` and ``A V``: ``2 * 2 * T * dim`` FLOPs per token and
        layer forward for full attention, halved for causal attention (``2 * T * dim``), times 3
        for forward plus backward: ``6 * T * dim`` per layer. Grouped-query attention does not
        change it (every query head still attends over T keys of width head_dim).

    ``args.n_layers`` and ``args.dim`` are used for the attention term, so a pipeline stage's
    model still reports the whole model's FLOPs; its parameter count is its own.
    """
    params = list(model.parameters())  # deduplicates shared Parameters
    nparams = sum(p.numel() for p in params)

    embedding = getattr(model, "tok_embeddings", None)
    output = getattr(model, "output", None)
    emb_numel = embedding.weight.numel() if embedding is not None else 0
    out_numel = output.weight.numel() if output is not None else 0
    tied = embedding is not None and output is not None and output.weight is embedding.weight

    matmul_params = nparams - emb_numel + (out_numel if tied else 0)
    flops_per_token = 6 * matmul_params + 6 * args.n_layers * args.dim * seq_len
    return nparams, int(flops_per_token)
