"""Context parallel: every rank of a ``cp`` group holds a slice of each sequence.

The approach of Llama 3 ("The Llama 3 Herd of Models", Dubey et al. 2024, section 3.3.2):

* The sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and
  ``2 * cp - 1 - r``. Under a causal mask, later chunks attend to more keys; pairing an early
  chunk with a late one gives every rank the same attention work.
* Attention all-gathers keys and values over the group (small next to the queries with
  grouped-query attention) and computes each local query chunk against its causal prefix: a full
  block for the chunks before it and a causal block for itself, merged through their
  log-sum-exp. Backward uses the same kernels with the merged output and log-sum-exp, and
  reduce-scatters the key/value gradients back to the ranks that own those positions.
* Everything else in the model works per position, so it only needs the rotary table of the
  positions this rank holds, and the loss is the mean over this rank's tokens (every rank holds
  as many, so the data-parallel gradient average over ``dp x cp`` gives the full-sequence mean).

The kernels are the flash-attention ops that return the log-sum-exp: the CPU one, and on CUDA
the flash (16-bit) or memory-efficient (float32) one; the same code runs over gloo and NCCL.

Block-causal attention (documents packed into a sequence attend only within themselves): the
kernel's ``mask_for`` all-gathers the document ids of the whole sequence once per forward, and
each local query chunk attends in one kernel call to the keys up to its end under an additive
mask of same-document, not-later positions (the CPU kernel, or CUDA's memory-efficient one, which
take a bias). No query row is fully masked (a position sees itself), so no merge is needed.

Sliding windows (gpt-oss) take the same one call, over only the keys from the window's start
before the chunk (which may lie in chunks other ranks hold) to the chunk's end, under a mask of
the window and, if any, the documents. Attention sinks (a logit per head in each softmax's
denominator) join the merged result as one more log-sum-exp part with a zero output; backward
then needs nothing new for the keys (the kernels take the final output and log-sum-exp), and the
sinks' gradient is ``-sum exp(S - lse) (dout . out)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

aten = torch.ops.aten


# ----------------------------------------------------------------------------- sequence layout


def chunk_ids(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two sequence chunks (of ``2 * cp``) that rank ``cp_rank`` holds, in order."""
    return cp_rank, 2 * cp - 1 - cp_rank


def shard_sequence(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim``: its two chunks, concatenated."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(
            f"context parallel: sequence length {x.shape[dim]} is not divisible into 2 x cp = "
            f"{2 * cp} chunks"
        )
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[i] for i in chunk_ids(cp, cp_rank)], dim=dim)


def unshard_sequence(parts: torch.Tensor, cp: int, dim: int = 1) -> torch.Tensor:
    """Inverse of ``shard_sequence`` over all ranks: ``parts[r]`` is rank r's part (as an
    all-gather stacks them); the result holds the whole sequence, in order, along ``dim``."""
    by_chunk: dict[int, torch.Tensor] = {}
    for rank in range(cp):
        by_chunk.update(zip(chunk_ids(cp, rank), parts[rank].chunk(2, dim=dim)))
    return torch.cat([by_chunk[i] for i in range(2 * cp)], dim=dim)


def _reshard_sequence(x: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """Each rank's part of a full sequence, stacked in dimension 0 (the reduce-scatter input)."""
    return torch.stack([shard_sequence(x, cp, r, dim=dim) for r in range(cp)])


# ----------------------------------------------------------------------------- kernels


def _attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:
    """``(out, lse [B, H, Lq] float32, what backward needs)``; causal is top-left aligned;
    ``bias`` an additive mask ``[B, 1, Lq, Lk]`` (0 or -inf) in the queries' dtype; ``scale``
    the softmax scale (None: ``1 / sqrt(head dim)``)."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return out, lse, ()
    if bias is None and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, *extra = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse, tuple(extra[:6])  # cum_seq_q/k, max_q/k, philox seed/offset
    bias = None if bias is None else bias.expand(q.shape[0], q.shape[1], -1, -1)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, 0.0, causal, scale=scale
    )
    # The memory-efficient kernel pads the log-sum-exp to a multiple of 32 positions.
    return out, lse[..., : q.shape[2]], (lse.shape[-1], seed, offset)


def _attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    extra: tuple[Any, ...],
    bias: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
        )
    if bias is None and q.dtype in (torch.float16, torch.bfloat16):
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            cum_q,
            cum_k,
            max_q,
            max_k,
            0.0,
            causal,
            seed,
            offset,
            scale=scale,
        )
    padded, seed, offset = extra
    lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1]))
    bias = None if bias is None else bias.expand(q.shape[0], q.shape[1], -1, -1)
    # The 16-bit memory-efficient backward reads ``out`` in the layout its forward wrote
    # (``[B, T, H, D]`` memory): given a standard contiguous ``out`` its dq and dk were wrong
    # (measured on an H100: errors of 0.7 against 0.008).
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        k,
        v,
        bias,
        out,
        lse,
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


def _merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over keys ``A + B`` from its parts over ``A`` and over ``B``."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


# ----------------------------------------------------------------------------- attention


def _gather_sequence(x: torch.Tensor, group: str, cp: int) -> torch.Tensor:
    """All ranks' parts of ``x [B, H, T/cp, D]``, in sequence order: ``[B, H, T, D]``."""
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x.contiguous(), 0, group))
    return unshard_sequence(gathered.unflatten(0, (cp, x.shape[0])), cp, dim=2)


def _scatter_grad(grad: torch.Tensor, group: str, cp: int, dtype: torch.dtype) -> torch.Tensor:
    """Sum the full-sequence gradient over ranks and keep this rank's part of it."""
    parts = _reshard_sequence(grad, cp, dim=2).flatten(0, 1)  # [cp * B, H, T/cp, D]
    mine = funcol.reduce_scatter_tensor(parts.contiguous(), "sum", 0, group)
    return funcol.wait_tensor(mine).to(dtype)


def _heads_for_kernel(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Keys or values ``[B, H_kv, T, D]`` as the attention kernel takes them. The CPU kernel takes
    the kv heads as they are (each serving ``n_rep`` consecutive query heads); for the CUDA
    kernels they are repeated to one per query head, as their grouped-query support is not
    verified here (no GPU)."""
    if n_rep == 1 or x.device.type == "cpu":
        return x
    return x.repeat_interleave(n_rep, dim=1)


def _first_key(chunk: int, c: int, window: int | None) -> int:
    """The first key any query of sequence chunk ``chunk`` sees: 0, or within its ``window``."""
    return 0 if window is None else max(0, chunk * c - window + 1)


def _mask_bias(
    doc_ids: torch.Tensor | None,
    chunk: int,
    c: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """The additive mask ``[B or 1, 1, c, keys]`` of sequence chunk ``chunk``'s queries over the
    keys from :func:`_first_key` to the chunk's end: 0 where the key is not later, within the
    ``window`` (if any: the query's last ``window`` keys, itself included) and in the same
    document (if ``doc_ids``), else -inf. No row is all -inf (a query sees itself). The last
    dimension is allocated padded to a multiple of 16, the alignment CUDA's memory-efficient
    kernel asks of a bias."""
    lo, hi = _first_key(chunk, c, window), (chunk + 1) * c
    q_pos = torch.arange(chunk * c, hi, device=device)[:, None]
    k_pos = torch.arange(lo, hi, device=device)
    allowed = k_pos <= q_pos  # [c, keys]
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    allowed = allowed.unsqueeze(0)
    if doc_ids is not None:  # [B, c, keys]
        allowed = allowed & (doc_ids[:, chunk * c : hi, None] == doc_ids[:, None, lo:hi])
    padded = -(-(hi - lo) // 16) * 16
    bias = torch.empty(allowed.shape[0], 1, c, padded, dtype=dtype, device=device)
    bias = bias[..., : hi - lo]
    bias.copy_(torch.where(allowed, 0.0, float("-inf")).unsqueeze(1))
    return bias


def _pieces(chunk: int, c: int, masked: bool, window: int | None) -> list[tuple[slice, bool]]:
    """The kernel calls of chunk ``chunk``'s queries: ``(keys, causal)`` each.

    Causal: a causal block over the chunk itself and, after the first chunk, a full block over
    every chunk before it (merged through their log-sum-exp). ``masked`` (documents or a
    window): one call over the keys from :func:`_first_key` to the chunk's end, under
    :func:`_mask_bias`."""
    if masked:
        return [(slice(_first_key(chunk, c, window), (chunk + 1) * c), False)]
    pieces = [(slice(chunk * c, (chunk + 1) * c), True)]
    if chunk > 0:
        pieces.append((slice(0, chunk * c), False))
    return pieces


def _with_sinks(
    out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention and its log-sum-exp with the sink logit ``sinks [H]`` joining each row's softmax
    denominator: :func:`_merge` with a part of log-sum-exp ``S_h`` that adds nothing to the
    output (``models/common/sink_window.py``)."""
    sink = sinks.float().view(1, -1, 1).expand_as(lse)
    return _merge(out, lse, torch.zeros_like(out), sink)


def _sink_grad(
    dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """The gradient of the sinks: for each row ``-p_sink * (dout . out)``, with ``p_sink =
    exp(S_h - lse)`` its probability, summed over the batch and positions of each head."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    d = (dout.float() * out.float()).sum(-1)
    return -(p_sink * d).sum((0, 2)).to(sinks.dtype)


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, doc_ids, sinks, group, cp, cp_rank, scale, window):  # type: ignore[override]
        k_all, v_all = _gather_sequence(k, group, cp), _gather_sequence(v, group, cp)
        n_rep = q.shape[1] // k.shape[1]
        keys, values = _heads_for_kernel(k_all, n_rep), _heads_for_kernel(v_all, n_rep)
        values = _padded_values(values, q.shape[-1])
        c = q.shape[2] // 2  # chunk length
        masked = doc_ids is not None or window is not None
        outs, lses, extras, biases = [], [], [], []
        for slot, chunk in enumerate(chunk_ids(cp, cp_rank)):
            q_c = q[:, :, slot * c : (slot + 1) * c]
            merged, slot_extras = None, []
            bias = _mask_bias(doc_ids, chunk, c, window, q.dtype, q.device) if masked else None
            for at, causal in _pieces(chunk, c, masked, window):
                piece = _attention_forward(
                    q_c, keys[:, :, at], values[:, :, at], causal, bias, scale
                )
                merged = piece[:2] if merged is None else _merge(*merged, *piece[:2])
                slot_extras.append(piece[2])
                biases.append(bias)
            if sinks is not None:
                merged = _with_sinks(*merged, sinks)
            outs.append(merged[0])
            lses.append(merged[1])
            extras.append(slot_extras)
        out = torch.cat(outs, dim=2)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k_all, v_all, out, lse, doc_ids, sinks, *biases)
        ctx.extras, ctx.group, ctx.cp, ctx.cp_rank = extras, group, cp, cp_rank
        ctx.k_dtype, ctx.scale, ctx.v_dim, ctx.window = k.dtype, scale, v.shape[-1], window
        return out[..., : v.shape[-1]]

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        q, k_all, v_all, out, lse, doc_ids, sinks, *biases = ctx.saved_tensors
        n_rep = q.shape[1] // k_all.shape[1]
        keys, values = _heads_for_kernel(k_all, n_rep), _heads_for_kernel(v_all, n_rep)
        values = _padded_values(values, q.shape[-1])
        dout = _padded_values(dout, q.shape[-1])  # the padding channels' outputs: no gradient
        dq = torch.empty_like(q)
        dk = torch.zeros(keys.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        c = q.shape[2] // 2
        biases_left = iter(biases)
        for slot, chunk in enumerate(chunk_ids(ctx.cp, ctx.cp_rank)):
            mine = slice(slot * c, (slot + 1) * c)
            # The fused backward kernels read out/lse/dout by raw pointer and assume the dense
            # layout their forward wrote: a sequence slice of lse [B, H, L] is strided and would
            # be read wrongly on CUDA, so every slice is made contiguous.
            dout_c, q_c, out_c, lse_c = (x[:, :, mine].contiguous() for x in (dout, q, out, lse))
            dq_c = torch.zeros(q_c.shape, dtype=torch.float32, device=q.device)
            pieces = _pieces(chunk, c, doc_ids is not None or ctx.window is not None, ctx.window)
            for (at, causal), extra in zip(pieces, ctx.extras[slot]):
                bias = next(biases_left)
                g_q, g_k, g_v = _attention_backward(
                    dout_c,
                    q_c,
                    keys[:, :, at].contiguous(),
                    values[:, :, at].contiguous(),
                    out_c,
                    lse_c,
                    causal,
                    extra,
                    bias,
                    ctx.scale,
                )
                dq_c += g_q.float()
                dk[:, :, at] += g_k.float()
                dv[:, :, at] += g_v.float()
            dq[:, :, mine] = dq_c.to(q.dtype)
        dv = dv[..., : ctx.v_dim]
        if keys.shape[1] != k_all.shape[1]:  # repeated: each copy served one query head
            dk = dk.unflatten(1, (-1, n_rep)).sum(2)
            dv = dv.unflatten(1, (-1, n_rep)).sum(2)
        dk = _scatter_grad(dk, ctx.group, ctx.cp, ctx.k_dtype)
        dv = _scatter_grad(dv, ctx.group, ctx.cp, ctx.k_dtype)
        d_sinks = _sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[4] else None
        return dq, dk, dv, None, d_sinks, None, None, None, None, None


def _padded_values(v: torch.Tensor, qk_dim: int) -> torch.Tensor:
    """Values (or output gradients) zero-padded to the query/key head size: the fused kernels
    take one head size, and zero value channels add zero output channels (multi-head latent
    attention's values are narrower than its queries and keys)."""
    if v.shape[-1] == qk_dim:
        return v
    return torch.nn.functional.pad(v, (0, qk_dim - v.shape[-1]))


def all_gather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values, or
    block-causal within documents when ``doc_ids [B, T]`` (the whole sequence's) are given.

    ``q [B, H, T/cp, D]``, ``k [B, H_kv, T/cp, D]``, ``v [B, H_kv, T/cp, Dv]`` (``Dv <= D``),
    each holding this rank's two chunks (``shard_sequence``); returns ``[B, H, T/cp, Dv]``.
    ``scale``: the softmax scale (None: ``1 / sqrt(D)``). ``sinks [H]``: a learned logit per
    query head in each softmax's denominator; ``window``: each query sees its last ``window``
    keys, itself included, wherever they are held (gpt-oss: ``models/common/sink_window.py``).
    Functional collectives keep it traceable by ``torch.compile``.
    """
    cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    return _AllGatherAttention.apply(
        q, k, v, doc_ids, sinks, group.group_name, cp, cp_rank, scale, window
    )


class ContextParallelAttention(nn.Module):
    """Drop-in for the model's attention kernel when the sequence is split over ``group``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def mask_for(self, doc_ids: torch.Tensor, windows: Any = ()) -> torch.Tensor:
        """The whole sequence's document ids (gathered once per forward) from this rank's
        ``doc_ids [B, T/cp]``: every rank's attention needs those of all keys. The layers'
        ``windows`` are applied by each layer's call."""
        cp = dist.get_world_size(self.group)
        gathered = funcol.all_gather_tensor(doc_ids.contiguous(), 0, self.group.group_name)
        parts = funcol.wait_tensor(gathered).unflatten(0, (cp, doc_ids.shape[0]))
        return unshard_sequence(parts, cp, dim=1)

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
        return all_gather_attention(
            q, k, v, self.group, doc_ids=mask, scale=scale, sinks=sinks, window=window
        )


# ----------------------------------------------------------------------------- model


def apply_cp(model: nn.Module, cp_mesh: Any) -> None:
    """Swap every block's attention kernel for the all-gather one (a linear-attention block's
    convolution and delta rule for the ones that continue across chunks:
    ``context_parallel_linear.py``) and give each block the rotary table rows of the positions
    this rank holds."""
    from torchtitan.distributed.context_parallel_linear import (  # it imports this module
        ContextParallelConv,
        ContextParallelDeltaRule,
    )

    group, cp, cp_rank = cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank()

    def local_positions(module: nn.Module, args: tuple) -> tuple:
        x, rope_cache, *rest = args
        seq_len = x.shape[1] * cp  # x holds this rank's T / cp positions
        return x, shard_sequence(rope_cache[:seq_len], cp, cp_rank, dim=0), *rest

    for block in model.layers.values():
        mixer = block.attention
        if hasattr(mixer, "rule"):  # linear attention (models/common/gated_deltanet.py)
            mixer.conv = ContextParallelConv(group)
            mixer.rule = ContextParallelDeltaRule(group, mixer.rule.chunk_size)
        else:
            mixer.sdpa = ContextParallelAttention(group)
        mixer.register_forward_pre_hook(local_positions)
