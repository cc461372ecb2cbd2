"""Attention with a learned sink logit per head and a sliding window (gpt-oss), exact everywhere.

For query ``i`` of head ``h`` and the keys ``j`` it may see (causal or block-causal; with a window
``W`` also ``i - W < j <= i``: ``W`` keys, itself included)::

    p_ij = exp(s_ij) / (exp(S_h) + sum_j' exp(s_ij')),   s_ij = q_i . k_j * scale,   o_i = sum_j p_ij v_j

The sink ``S_h`` (one learned logit per query head, not scaled) joins the denominator and attends
to nothing. Three ways to the same numbers:

* :func:`sink_attention`: the ``T x T`` scores written out. The oracle of the tests.
* :func:`sdpa_sink_window`, every device: torch's fused SDPA (forward and backward). The sink is
  folded in exactly as one more key: each query gets one more channel, ``-S_h / scale``, each key
  the channel ``1``, so every score drops by ``S_h``; the extra key is zero (score 0) with a zero
  value. That changes no probability: ``e^(s - S) / (e^0 + sum e^(s' - S))`` is ``p`` above, and
  autograd reaches ``S_h`` through SDPA's own backward. A window is banded: queries go in
  chunks of ``W``, each chunk attends to its own and the previous chunk (``2W`` keys), so a window
  costs ``T x 2W`` scores instead of ``T x T``.
* :func:`flex_sink_window`, CUDA under a FlexAttention block mask: attention without the sink
  and its log-sum-exp, then ``o * sigmoid(lse - S_h)`` (``e^lse / (e^lse + e^S)``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F


def sliding_window_mask(t: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """``[T, T]`` bool: query ``i`` sees key ``j`` when ``i - window < j <= i``, ``window`` keys
    with itself included (gpt-oss: 128; FlashAttention's inclusive ``(window - 1, 0)``). AND it
    with :func:`~torchtitan.models.common.attention.document_mask` for block-causal windows."""
    pos = torch.arange(t, device=device)
    back = pos.unsqueeze(1) - pos.unsqueeze(0)  # i - j
    return (back >= 0) & (back < window)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention with a learned sink logit per query head (gpt-oss): ``sinks [H]`` joins
    each row's softmax denominator and attends to nothing,
    ``p_ij = exp(s_ij) / (exp(S_h) + sum_j' exp(s_ij'))`` over the keys ``mask`` allows, with
    ``s = q . k * scale``; the sink is not scaled. ``q [B, H, T, D]``, ``k, v [B, H_kv, T, D]``
    (query head ``h`` reads kv head ``h // (H / H_kv)``), ``mask`` a bool mask broadcasting to
    ``[B, H, T, T]`` (None: causal) -> ``[B, H, T, D]``.

    Computed exactly in the logits' dtype, the ``T x T`` scores materialized: the oracle. The
    same numbers are ``o_std * sigmoid(lse - S_h)`` from ordinary attention and its log-sum-exp,
    the form a fused kernel uses."""
    batch, heads, t, d = q.shape
    groups = heads // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if mask is None:
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    logits = (q @ k.transpose(-2, -1)) * (d**-0.5 if scale is None else scale)
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).reshape(1, heads, 1, 1).expand(batch, heads, t, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _fold_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [..., H, Tq, D]``, ``k, v [..., H_kv, S, D]`` with the sink as one more key, the last
    (``first``: the first, and a zero query before the others, so that a causal kernel's query
    ``i + 1`` sees the sink and keys ``0..i``): queries get the channel ``-S_h / scale``, keys
    the channel 1, the sink key and value are zero. The channels are padded with zeros to a
    multiple of 8 (fused kernels' alignment), the values' to the same width (CPU's fused kernel
    wants one width for all three); slice the output back to the values' width."""
    d = q.shape[-1]
    extra = 8 - d % 8  # at least the one channel
    shift = (-sinks / scale).to(q.dtype).reshape(-1, 1, 1).expand(*q.shape[:-1], 1)
    q = torch.cat([q, shift, q.new_zeros(*q.shape[:-1], extra - 1)], dim=-1)
    k = torch.cat([k, k.new_ones(*k.shape[:-1], 1), k.new_zeros(*k.shape[:-1], extra - 1)], -1)
    if v.shape[-1] < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - v.shape[-1]))

    def one_more(x: torch.Tensor) -> torch.Tensor:  # a zero row before or after the others
        zero = x.new_zeros(*x.shape[:-2], 1, x.shape[-1])
        return torch.cat([zero, x] if first else [x, zero], dim=-2)

    return (one_more(q) if first else q), one_more(k), one_more(v)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sinks: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """SDPA under the bool mask ``allowed`` (broadcasting to ``[N, H, Tq, S]``), the sink folded in."""
    width = v.shape[-1]
    if sinks is not None:
        q, k, v = _fold_sinks(q, k, v, sinks, scale)
        allowed = torch.cat([allowed, allowed.new_ones(*allowed.shape[:-1], 1)], dim=-1)
    groups = q.shape[-3] // k.shape[-3]
    if groups > 1 and q.is_cuda:  # CUDA's fused kernels take a mask or GQA, not both
        k, v = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    gqa = q.shape[-3] != k.shape[-3]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    return out[..., :width]


def _chunks(x: torch.Tensor, window: int, n: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, n, H, 2W, D]``: chunk ``c``'s keys, positions ``(c-1)W`` to
    ``(c+1)W - 1`` (zeros before 0 and after ``T``)."""
    padded = F.pad(x, (0, 0, window, n * window - x.shape[2]))
    return padded.unfold(2, 2 * window, window).permute(0, 2, 1, 4, 3)


def _band(mask: torch.Tensor | None, t: int, window: int, n: int) -> torch.Tensor:
    """``[B or 1, n, 1, W, 2W]`` bool: which of its ``2W`` keys each query of each chunk sees
    (window, causal, no position before 0, and within the document under a ``[B, 1, T, T]``
    document ``mask``)."""
    device = mask.device if mask is not None else None
    qq = torch.arange(window, device=device).unsqueeze(1)
    kk = torch.arange(2 * window, device=device)
    back = window + qq - kk  # i - j for query qq of a chunk and key kk of its band
    pattern = (back >= 0) & (back < window)  # [W, 2W]
    first = torch.arange(n, device=device).unsqueeze(1) * window - window + kk >= 0  # [n, 2W]
    band = (pattern.unsqueeze(0) & first.unsqueeze(1)).unsqueeze(1).unsqueeze(0)
    if mask is None:
        return band
    pad = n * window - t
    rows = F.pad(mask, (window, pad, 0, pad)).unflatten(2, (n, window))  # [B, 1, n, W, W + nW]
    per_chunk = rows.unfold(-1, 2 * window, window).diagonal(dim1=2, dim2=4)  # [B, 1, W, 2W, n]
    # each query sees itself: already so for the real ones; the padding after T would see no key
    # (a fused kernel's NaN there reaches the keys' gradients through a zero)
    itself = back == 0
    return band & (per_chunk.permute(0, 4, 1, 2, 3) | itself)


def sdpa_sink_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`sink_attention`'s numbers through torch's fused SDPA: ``q [B, H, T, D]``, ``k, v
    [B, H_kv, T, D]``, ``sinks [H]`` or None, ``window`` keys (None: all earlier ones), ``mask``
    None (causal) or a ``[B, 1, T, T]`` bool document mask -> ``[B, H, T, D_v]``."""
    batch, heads, t, d = q.shape
    scale = d**-0.5 if scale is None else scale
    if (window is None or window >= t) and mask is None and sinks is not None:
        # the sink first and a zero query before the others: the causal kernel skips the
        # scores above the diagonal, as for attention without sinks
        width = v.shape[-1]
        q, k, v = _fold_sinks(q, k, v, sinks, scale, first=True)
        gqa = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return out[:, :, 1:, :width]
    if window is None or window >= t:  # a window as long as the sequence hides nothing
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        return _attend(q, k, v, causal if mask is None else mask & causal, sinks, scale)
    n = math.ceil(t / window)
    qc = F.pad(q, (0, 0, 0, n * window - t)).unflatten(2, (n, window)).transpose(1, 2)
    kc, vc = _chunks(k, window, n), _chunks(v, window, n)
    allowed = _band(mask, t, window, n).expand(batch, n, 1, window, 2 * window)
    out = _attend(
        qc.flatten(0, 1), kc.flatten(0, 1), vc.flatten(0, 1), allowed.flatten(0, 1), sinks, scale
    )
    return out.unflatten(0, (batch, n)).transpose(1, 2).flatten(2, 3)[:, :, :t]


def flex_sink_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: Any,
    sinks: torch.Tensor | None = None,
    compiled: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """FlexAttention under ``block_mask`` (the window, if any, is in it), the sink applied as
    ``o * sigmoid(lse - S_h)``. ``compiled=False``: torch's unfused reference, forward only on
    CPU (how the tests check this path here)."""
    from torchtitan.models.common.attention import flex_document_attention

    if sinks is None:
        return flex_document_attention(q, k, v, block_mask, compiled=compiled, scale=scale)
    out, lse = flex_document_attention(
        q, k, v, block_mask, compiled=compiled, scale=scale, return_lse=True
    )
    rescale = torch.sigmoid(lse.float() - sinks.float().reshape(1, -1, 1))
    return out * rescale.unsqueeze(-1).to(out.dtype)


def window_mask_mod(window: int) -> Any:
    """The FlexAttention ``mask_mod`` of a window: ``i - window < j <= i``."""

    def within(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return within
