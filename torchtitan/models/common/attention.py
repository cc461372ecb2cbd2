"""The attention kernel the families share: causal, or block-causal within packed documents.

``model.attn_mask_type``:

* ``causal``: every position attends to every earlier position of its row, across the
  documents packed into it (SDPA's ``is_causal``).
* ``block_causal``: a position attends only to earlier positions of its own document. The data
  loader says where documents start (``doc_ids``, see :mod:`torchtitan.data.batch`); the
  model turns them into a mask once per forward (:meth:`CausalAttention.mask_for`) and hands it
  to every block.

A learned sink logit per head in the softmax and a sliding window (gpt-oss,
docs/design/gpt_oss.md) are :mod:`.sink_window`'s; :class:`CausalAttention` takes both
(``sinks``, ``window``).

The block-causal kernel depends on the device, with one set of weights and the same numbers:

* CUDA: FlexAttention (compiled) with a ``BlockMask`` built once per batch; blocks of the score
  matrix that a mask rules out entirely are skipped, so short documents cost less than causal.
* CPU: torch's FlexAttention has no backward on CPU, so training uses SDPA with the boolean
  ``[B, 1, T, T]`` mask (exact; it computes every block). FlexAttention's CPU forward still runs,
  which is how the tests check the CUDA path's mask logic here.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.sink_window import (
    flex_sink_window,
    sdpa_sink_window,
    sink_attention,
    sliding_window_mask,
    window_mask_mod,
)

__all__ = [
    "ATTN_MASK_TYPES",
    "CausalAttention",
    "document_block_mask",
    "document_mask",
    "flex_document_attention",
    "sink_attention",
    "sliding_window_mask",
]

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
    return_lse: bool = False,
) -> Any:
    """FlexAttention of ``q [B, H, T, D]`` over ``k, v [B, H_kv, T, D]`` under ``block_mask``;
    ``compiled=False`` runs torch's unfused reference (the CPU check of the mask logic).
    ``return_lse``: ``(out, lse [B, H, T])``, the natural log-sum-exp of each row's scores."""
    from torch.nn.attention import flex_attention as flex

    fn = _compiled("flex_attention") if compiled else flex.flex_attention
    kwargs: dict[str, Any] = {"block_mask": block_mask, "enable_gqa": q.shape[1] != k.shape[1]}
    kwargs["scale"] = scale
    if not return_lse:
        return fn(q, k, v, **kwargs)
    if hasattr(flex, "AuxRequest"):  # torch >= 2.9; return_lse is deprecated there
        out, aux = fn(q, k, v, **kwargs, return_aux=flex.AuxRequest(lse=True))
        return out, aux.lse
    return fn(q, k, v, **kwargs, return_lse=True)


def windowed_block_mask(block_mask: Any, window: int) -> Any:
    """``block_mask`` AND a window of ``window`` keys, made once per block mask (it lives for a
    forward: every sliding layer of the batch shares it). ``CausalAttention.mask_for`` makes
    them before the blocks run, so a compiled block only looks its mask up."""
    from torch.nn.attention.flex_attention import and_masks, create_block_mask

    made = getattr(block_mask, "_torchtitan_windows", None)
    if made is None:
        made = block_mask._torchtitan_windows = {}
    if window not in made:
        batch, _, t, s = block_mask.shape
        mask_mod = and_masks(block_mask.mask_mod, window_mask_mod(window))
        build = (
            _compiled("create_block_mask")
            if block_mask.kv_num_blocks.is_cuda
            else create_block_mask
        )
        made[window] = build(mask_mod, batch, None, t, s, device=block_mask.kv_num_blocks.device)
    return made[window]


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

    def mask_for(self, doc_ids: torch.Tensor, windows: Iterable[int] = ()) -> Any:
        """What ``forward`` takes as ``mask`` for block-causal attention within the documents of
        ``doc_ids [B, T]``: a FlexAttention block mask on CUDA (with its versions for the
        sliding ``windows`` the layers use made now, outside any compiled block), a boolean
        mask elsewhere."""
        if doc_ids.is_cuda:
            mask = document_block_mask(doc_ids)
            for window in windows:
                windowed_block_mask(mask, window)
            return mask
        return document_mask(doc_ids)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: Any = None,
        scale: float | None = None,
        sinks: torch.Tensor | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """``scale``: the softmax scale, default ``1 / sqrt(D)`` of the queries' ``D``. Values
        may have a head size of their own (multi-head latent attention). ``sinks [H]``: a learned
        logit per query head in each softmax's denominator; ``window``: each query sees its last
        ``window`` keys, itself included (:mod:`.sink_window`)."""
        if sinks is not None or window is not None:
            if mask is None or isinstance(mask, torch.Tensor):
                return sdpa_sink_window(q, k, v, sinks, window, mask, scale)
            if window is not None:
                mask = windowed_block_mask(mask, window)
            return flex_sink_window(q, k, v, mask, sinks, scale=scale)
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
