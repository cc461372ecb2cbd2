"""The attention kernel the families share: causal, or block-causal within packed documents.

``model.attn_mask_type``:

* ``causal``: every position attends to every earlier position of its row, across the
  documents packed into it (SDPA's ``is_causal``).
* ``block_causal``: a position attends only to earlier positions of its own document. The data
  loader says where documents start (``doc_ids``, see :mod:`torchtitan.data.batch`); the
  model turns them into a mask once per forward (:meth:`CausalAttention.mask_for`) and hands it
  to every block.

Two pieces for families that need them (gpt-oss, docs/design/gpt_oss.md): a sliding window
(:func:`sliding_window_mask`) and a learned sink logit per head in the softmax
(:func:`sink_attention`).

The block-causal kernel depends on the device, with one set of weights and the same numbers:

* CUDA: FlexAttention (compiled) with a ``BlockMask`` built once per batch; blocks of the score
  matrix that a mask rules out entirely are skipped, so short documents cost less than causal.
* CPU: torch's FlexAttention has no backward on CPU, so training uses SDPA with the boolean
  ``[B, 1, T, T]`` mask (exact; it computes every block). FlexAttention's CPU forward still runs,
  which is how the tests check the CUDA path's mask logic here.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTN_MASK_TYPES = ("causal", "block_causal")


def document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]`` bool: query ``t`` may see key ``s`` when ``s <= t`` and both lie in the
    same document (``doc_ids [B, T]``)."""
    t = doc_ids.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids.unsqueeze(2) == doc_ids.unsqueeze(1))).unsqueeze(1)


def document_block_mask(doc_ids: torch.Tensor, compile_mask: bool | None = None) -> Any:
    """The FlexAttention ``BlockMask`` of :func:`document_mask` (heads broadcast). Built by a
    compiled kernel on CUDA (``compile_mask`` None: on CUDA only), so no ``T x T`` tensor exists."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (doc_ids[b, q_idx] == doc_ids[b, kv_idx])

    batch, t = doc_ids.shape
    compiled = doc_ids.is_cuda if compile_mask is None else compile_mask
    build = _compiled("create_block_mask") if compiled else create_block_mask
    return build(same_document_causal, batch, None, t, t, device=doc_ids.device)


def sliding_window_mask(t: int, window: int, device: torch.device | None = None) -> torch.Tensor:
    """``[T, T]`` bool: query ``i`` sees key ``j`` when ``i - window < j <= i``, ``window`` keys
    with itself included (gpt-oss: 128; FlashAttention's inclusive ``(window - 1, 0)``). AND it
    with :func:`document_mask` for block-causal windows."""
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

    Computed exactly in the logits' dtype, the ``T x T`` scores materialized: the CPU path. The
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


@cache
def _compiled(name: str) -> Any:
    """``torch.compile`` of a FlexAttention function, made once per process."""
    from torch.nn.attention import flex_attention

    return torch.compile(getattr(flex_attention, name), dynamic=False)


def flex_document_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: Any,
    compiled: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """FlexAttention of ``q [B, H, T, D]`` over ``k, v [B, H_kv, T, D]`` under ``block_mask``;
    ``compiled=False`` runs torch's unfused reference (the CPU check of the mask logic)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled("flex_attention") if compiled else flex_attention
    return fn(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1], scale=scale)


class CausalAttention(nn.Module):
    """Scaled dot-product attention, causal or block-causal: queries ``[B, H, T, D]``, keys and
    values ``[B, H_kv, T, D]`` -> ``[B, H, T, D]``.

    Each kv head serves ``H / H_kv`` consecutive query heads (Meta's ``repeat_kv`` convention).
    SDPA takes the kv heads as they are (``enable_gqa``): no copy of keys and values per query
    head, and no reduction of that copy's gradient in backward.
    A module of its own so that a parallelism can put another implementation of the same math in
    its place (context parallel swaps in one that gathers keys and values across ranks); such a
    replacement provides its own ``mask_for``.
    """

    def mask_for(self, doc_ids: torch.Tensor) -> Any:
        """What ``forward`` takes as ``mask`` for block-causal attention within the documents of
        ``doc_ids [B, T]``: a FlexAttention block mask on CUDA, a boolean mask elsewhere."""
        if doc_ids.is_cuda:
            return document_block_mask(doc_ids)
        return document_mask(doc_ids)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """``scale``: the softmax scale, default ``1 / sqrt(D)`` of the queries' ``D``. Values
        may have a head size of their own (multi-head latent attention)."""
        gqa = q.shape[1] != k.shape[1]
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=gqa, scale=scale
            )
        if isinstance(mask, torch.Tensor):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale
            )
        return flex_document_attention(q, k, v, mask, scale=scale)
