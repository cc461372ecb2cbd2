"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, "Gated Delta Networks", arXiv:2412.06464): linear
attention with a decaying, delta-rule state, as Qwen3-Next's linear-attention layers use it.

Model math only, no parallelism. Per value head, the state ``S`` is a ``[Dk, Dv]`` matrix. Token
``t`` (query ``q_t``, key ``k_t``, value ``v_t``, log-decay ``g_t <= 0``, write strength
``beta_t`` in (0, 1)) first decays it, then writes the part of ``v_t`` the state does not
predict yet (the delta rule), then reads it::

    S <- exp(g_t) S
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = S^T q_t

* :func:`gated_delta_recurrent`: that loop, one token at a time: the reference.
* :func:`gated_delta_chunked`: the same numbers for training, ``chunk_size`` tokens at once
  (the WY form of the paper, section 3, as ``transformers``' ``torch_chunk_gated_delta_rule`` and
  the ``fla`` kernels compute it): within a chunk, the writes are one triangular solve and a few
  matmuls; a loop over chunks carries the state.

Both take ``resets [B, T]`` (True where a document starts): the state is emptied before that
token, so packed documents never see each other. In the chunked form a reset is a decay of zero,
which makes every product of decays spanning it zero: the within-chunk pairs of different
documents, the carried state's reach into the chunk, and the chunk's writes into the next.
Both also take an incoming ``state`` and return the final one, which is what context parallel
hands from one rank's part of a sequence to the next.

:func:`causal_conv` is the short depthwise causal convolution before the rule (each channel mixes
its last ``K`` positions), stopped at document starts, and able to continue a sequence from the
previous part's last ``K - 1`` positions. :class:`GatedDeltaNet` is the layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.blocks import local_part, trunc_normal_

__all__ = [
    "CausalConv",
    "DeltaRule",
    "GatedDeltaNet",
    "causal_conv",
    "delta_rule_flops",
    "document_starts",
    "gated_delta_chunked",
    "gated_delta_recurrent",
    "gated_rms_norm",
    "l2_normalize",
]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the ``fla`` kernels' and ``transformers``'
    form, with ``eps`` inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads_first(*xs: torch.Tensor) -> list[torch.Tensor]:
    """``[B, T, H, ...]`` -> ``[B, H, T, ...]`` float32 (the rule is computed in float32)."""
    return [x.transpose(1, 2).float() for x in xs]


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token (the reference). ``q, k [B, T, H, Dk]`` (normalized
    and scaled by the caller), ``v [B, T, H, Dv]``, ``g, beta [B, T, H]``, ``state [B, H, Dk, Dv]``
    (None: zeros), ``resets [B, T]`` bool. Returns the outputs ``[B, T, H, Dv]`` in ``v``'s dtype
    and the final state (float32)."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    batch, heads, t, dk = k.shape
    if state is None:
        state = q.new_zeros(batch, heads, dk, v.shape[-1])
    state = state.float()
    outs = []
    for i in range(t):
        decay = g[:, :, i].exp()[..., None, None]
        if resets is not None:
            decay = decay * (~resets[:, i]).float()[:, None, None, None]
        state = state * decay
        k_i = k[:, :, i]
        delta = (v[:, :, i] - (state * k_i[..., None]).sum(-2)) * beta[:, :, i, None]
        state = state + k_i[..., None] * delta[..., None, :]
        outs.append((state * q[:, :, i, :, None]).sum(-2))
    return torch.stack(outs, dim=1).to(dtype), state


def _chunk_masks(
    resets: torch.Tensor | None, n: int, c: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For chunks of ``c`` positions: ``pair [B or 1, 1, n, c, c]`` (key ``j`` reaches query
    ``i``: ``j <= i`` with no document start in ``(j, i]``), ``carry [B or 1, 1, n, c]`` (the
    incoming state reaches position ``i``: no start in ``[0, i]``) and ``tail`` (position ``j``'s
    write reaches the chunk's end: no start in ``(j, c - 1]``)."""
    causal = torch.ones(c, c, dtype=torch.bool, device=device).tril()
    if resets is None:
        ones = torch.ones(1, 1, n, c, dtype=torch.bool, device=device)
        return causal.expand(1, 1, n, c, c), ones, ones
    starts = resets.view(resets.shape[0], 1, n, c).cumsum(-1)  # starts in [0, i] of each chunk
    pair = causal & (starts[..., :, None] == starts[..., None, :])
    return pair, starts == 0, starts == starts[..., -1:]


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    state: torch.Tensor | None = None,
    resets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gated_delta_recurrent`'s numbers, ``chunk_size`` positions at a time (any length:
    the last chunk is padded with positions that neither decay nor write)."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    batch, heads, t, dk = k.shape
    c = chunk_size
    pad = -t % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        resets = None if resets is None else F.pad(resets, (0, pad))
    n = (t + pad) // c
    q, k, v = (x.unflatten(2, (n, c)) for x in (q, k, v))  # [B, H, n, c, D]
    g, beta = g.unflatten(2, (n, c)), beta.unflatten(2, (n, c))
    pair, carry, tail = _chunk_masks(resets, n, c, q.device)
    gamma = g.cumsum(-1)  # log of the decay from the chunk's start through position i
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~pair, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # the writes within a chunk: (I + L) U = V beta, L the strictly lower part of the keys'
    # decayed overlaps (the diagonal is skipped: unitriangular)
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(
        system, v * beta[..., None], upper=False, unitriangular=True
    )
    reach = gamma.exp() * carry  # the incoming state's decay at each position
    state_keys = torch.linalg.solve_triangular(
        system, k_beta * reach[..., None], upper=False, unitriangular=True
    )
    inner = (q @ k.transpose(-1, -2)) * decay
    q_state = q * reach[..., None]
    k_out = k * ((gamma[..., -1:] - gamma).exp() * tail)[..., None]
    chunk_decay = (gamma[..., -1].exp() * carry[..., -1])[..., None, None]  # [B, H, n, 1, 1]
    if state is None:
        state = q.new_zeros(batch, heads, dk, v.shape[-1])
    state = state.float()
    outs = []
    # a Python loop: under torch.compile it is unrolled, one copy per chunk (64 at 4096
    # positions); a sequence length of its own compiles its own graph
    # unbound once: indexing chunk i in the loop would cost a full-size gradient per chunk in
    # backward (quadratic in the sequence; measured 3x slower per token at 32768 than at 8192)
    chunks = (x.unbind(2) for x in (new_values, state_keys, q_state, inner, k_out, chunk_decay))
    for values, keys, queries, within, keys_out, carry_decay in zip(*chunks):
        written = values - keys @ state
        outs.append(queries @ state + within @ written)
        state = state * carry_decay + keys_out.transpose(-1, -2) @ written
    out = torch.stack(outs, dim=2).flatten(2, 3)[:, :, :t]
    return out.transpose(1, 2).to(dtype), state


def delta_rule_flops(heads: int, dk: int, dv: int, chunk_size: int) -> float:
    """Training FLOPs per token of :func:`gated_delta_chunked` over ``heads`` value heads
    (forward and backward: 3 x the forward's, ``2`` per multiply-add), as the chunked form
    computes them, dense ``C x C`` blocks included (``C = chunk_size``), per head and token:
    the keys' and the queries' overlaps within the chunk (``2 C dk``), the two triangular solves
    (``C (dk + dv) / 2``), the within-chunk read (``C dv``), and the state's read by the queries
    and by the keys and its update (``3 dk dv``). Linear in the sequence length: nothing here
    grows with it. The short convolution and the projections are parameters (``6 N``)."""
    c = chunk_size
    per_head = 2 * c * dk + c * (dk + dv) / 2 + c * dv + 3 * dk * dv
    return 6 * heads * per_head


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    tail: torch.Tensor | None = None,
    tail_doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal convolution: ``out[t] = sum_s weight[:, K - 1 - s] * x[t - s]`` over
    ``s < K`` (``F.conv1d`` with ``K - 1`` positions of left padding), accumulated in float32,
    ``x [B, T, C]``, ``weight [C, K]``. With ``doc_ids [B, T]``, a position before the document
    of ``t`` adds nothing. ``tail [B, K - 1, C]``: the positions before ``x`` (the previous part
    of the sequence, with their ``tail_doc_ids``); None: the sequence starts here."""
    width = weight.shape[1] - 1
    if tail is None:
        tail = x.new_zeros(x.shape[0], width, x.shape[2])
    full = torch.cat([tail.to(x.dtype), x], dim=1)
    if doc_ids is not None:
        if tail_doc_ids is None:  # zeros before the sequence: whatever their document
            tail_doc_ids = doc_ids[:, :1].expand(-1, width)
        docs = torch.cat([tail_doc_ids, doc_ids], dim=1)
    t, out = x.shape[1], None
    full, weight = full.float(), weight.float()  # accumulated in float32, rounded once
    for s in range(width + 1):
        term = full[:, width - s : width - s + t] * weight[:, width - s]
        if doc_ids is not None and s:
            term = term * (docs[:, width - s : width - s + t] == doc_ids)[..., None]
        out = term if out is None else out + term
    return out.to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim, scaled by ``weight``, then gated by ``silu(gate)``
    (computed in float32; the normalized ``x`` rounded to its dtype before the scale, as
    ``transformers``' ``Qwen3NextRMSNormGated`` does)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed * F.silu(gate.float())).to(x.dtype)


class CausalConv(nn.Module):
    """:func:`causal_conv` as a module (``forward(x, weight, doc_ids)``), so that a parallelism
    may swap in a version that continues each part of a sequence from the part before it."""

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return causal_conv(x, weight, doc_ids)


class DeltaRule(nn.Module):
    """:func:`gated_delta_chunked` over whole sequences, documents reset at their starts
    (``forward(q, k, v, g, beta, doc_ids) -> out``); a parallelism may swap it too."""

    def __init__(self, chunk_size: int = 64) -> None:
        super().__init__()
        self.chunk_size = chunk_size

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        resets = None if doc_ids is None else document_starts(doc_ids)
        return gated_delta_chunked(q, k, v, g, beta, self.chunk_size, resets=resets)[0]


class GatedRMSNorm(nn.Module):
    """:func:`gated_rms_norm` with its ``weight [dim]`` (initialized to ones)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention layer: ``forward(x [B, T, dim], doc_ids [B, T] or None)``.

    ``G`` key heads, each serving ``r = H / G`` of the ``H`` value heads (as a kv head serves
    query heads in grouped-query attention). The projections keep ``transformers``' layout,
    grouped by key head, so a column-wise split into whole groups gives each tensor-parallel rank
    whole heads of everything (head counts are read from the projected shapes):

    * ``in_proj_qkvz``: for each group, its query ``[Dk]``, key ``[Dk]``, values ``[r, Dv]`` and
      output gates ``z [r, Dv]``; ``in_proj_ba``: for each group, ``b [r]`` then ``a [r]``;
    * ``conv_weight [G (2 Dk + r Dv), K]``: the depthwise causal convolution of each group's
      query, key and values (grouped too: ``transformers``' ``conv1d.weight`` holds all queries,
      then all keys, then all values, and the state-dict adapter reorders it);
    * then SiLU, L2-normalized queries and keys (queries also scaled by ``Dk^-1/2``),
      ``beta = sigmoid(b)``, log-decay ``g = -exp(A_log) * softplus(a + dt_bias)``, the rule
      (:func:`gated_delta_chunked`), :class:`GatedRMSNorm` of each head's output gated by ``z``,
      and ``out_proj``.
    """

    def __init__(
        self,
        dim: int,
        n_key_heads: int,
        n_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        chunk_size: int = 64,
    ) -> None:
        super().__init__()
        if n_value_heads % n_key_heads:
            raise ValueError(
                f"linear attention: n_value_heads ({n_value_heads}) must be a multiple of "
                f"n_key_heads ({n_key_heads})"
            )
        r = n_value_heads // n_key_heads
        self.dk, self.dv, self.r = key_head_dim, value_head_dim, r
        self.in_proj_qkvz = nn.Linear(
            dim, n_key_heads * (2 * key_head_dim + 2 * r * value_head_dim), bias=False
        )
        self.in_proj_ba = nn.Linear(dim, n_key_heads * 2 * r, bias=False)
        conv_channels = n_key_heads * (2 * key_head_dim + r * value_head_dim)
        self.conv_weight = nn.Parameter(torch.empty(conv_channels, conv_kernel))
        self.A_log = nn.Parameter(torch.empty(n_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(n_value_heads))
        self.norm = GatedRMSNorm(value_head_dim, norm_eps)
        self.out_proj = nn.Linear(n_value_heads * value_head_dim, dim, bias=False)
        self.conv, self.rule = CausalConv(), DeltaRule(chunk_size)  # no parameters

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``qkv [B, T, G (2 Dk + r Dv)]`` (grouped, before the convolution), ``z [B, T, H, Dv]``,
        ``b, a [B, T, H]``."""
        dk, dv, r = self.dk, self.dv, self.r
        qkvz = self.in_proj_qkvz(x).unflatten(-1, (-1, 2 * dk + 2 * r * dv))
        qkv, z = qkvz.split((2 * dk + r * dv, r * dv), dim=-1)
        ba = self.in_proj_ba(x).unflatten(-1, (-1, 2 * r))
        b, a = ba[..., :r].flatten(-2), ba[..., r:].flatten(-2)
        return qkv.flatten(-2), z.reshape(*z.shape[:2], -1, dv), b, a

    def rule_inputs(
        self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """From the convolved ``qkv``: ``q, k [B, T, H, Dk]`` (normalized, ``q`` scaled, each key
        head repeated for its ``r`` value heads), ``v [B, T, H, Dv]``, ``g, beta [B, T, H]``."""
        dk, dv, r = self.dk, self.dv, self.r
        q, k, v = F.silu(qkv).unflatten(-1, (-1, 2 * dk + r * dv)).split((dk, dk, r * dv), dim=-1)
        q = l2_normalize(q.float()) * dk**-0.5
        k = l2_normalize(k.float())
        q, k = (t.repeat_interleave(r, dim=2) for t in (q, k))
        v = v.reshape(*v.shape[:2], -1, dv)
        a_log, dt_bias = local_part(self.A_log), local_part(self.dt_bias)  # this rank's heads
        g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
        return q, k, v, g, torch.sigmoid(b.float())

    def forward(self, x: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        qkv, z, b, a = self.project(x)
        qkv = self.conv(qkv, local_part(self.conv_weight), doc_ids)
        out = self.rule(*self.rule_inputs(qkv, b, a), doc_ids)
        out = self.norm(out, z)
        return self.out_proj(out.flatten(-2))

    @torch.no_grad()
    def init_weights(self, init_std: float) -> None:
        """Projections: truncated normal std 0.02, ``out_proj`` the given (depth-scaled) std;
        the convolution as ``nn.Conv1d`` draws it (uniform within ``1/sqrt(K)``); ``dt_bias`` one
        and ``A = exp(A_log)`` uniform in [0.01, 16] (``transformers``' init); the norm one."""
        trunc_normal_(self.in_proj_qkvz.weight, std=0.02)
        trunc_normal_(self.in_proj_ba.weight, std=0.02)
        trunc_normal_(self.out_proj.weight, std=init_std)
        bound = self.conv_weight.shape[1] ** -0.5
        self.conv_weight.uniform_(-bound, bound)
        self.dt_bias.fill_(1.0)
        self.A_log.uniform_(0.01, 16.0).log_()
        self.norm.weight.fill_(1.0)


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: where a document starts (a position whose id differs from the one
    before; the first position is not marked: the state is empty there anyway)."""
    starts = torch.zeros_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return starts
