"""Context parallel for linear attention (Gated DeltaNet, ``models/common/gated_deltanet.py``).

A DeltaNet layer reads the sequence through a recurrent state, not through all-to-all scores, so
the all-gather of keys and values that serves softmax attention (``context_parallel.py``) does not
apply. Each CP rank holds the same two chunks of every sequence as there (rank ``r``: chunks
``r`` and ``2 cp - 1 - r`` of ``2 cp``), and two things cross chunk boundaries:

* **The convolution's tail.** A chunk's first ``K - 1`` positions mix the previous chunk's last
  ``K - 1`` inputs: every rank's chunk ends are all-gathered (with autograd: their gradients go
  back to their owners), with the document ids, so the convolution stops at document starts there
  too (:class:`ContextParallelConv`).
* **The state.** The rule is linear in its state: over a chunk, ``S_out = P S_in + W``, where ``W``
  is the chunk's final state from an empty one and ``P`` (``[Dk, Dk]`` per head) how the chunk
  carries an incoming state. Each rank computes its chunks from an empty state in parallel, with
  ``Dk`` more value channels that carry the identity as their incoming state: those channels'
  final state is ``P``, and their outputs ``o_I`` say how each position reads an incoming state
  (``o = o_0 + o_I S_in``). The ranks all-gather every chunk's ``(W, P)`` (small: ``Dk x (Dv + Dk)``
  per head), every rank folds them in sequence order into each chunk's incoming state, and adds
  ``o_I S_in`` to its outputs (:class:`ContextParallelDeltaRule`). No rank waits for another's
  chunk; the price is ``Dk`` more value channels in the rule (twice its work when ``Dk = Dv``).
  A document start inside a chunk zeroes ``P`` from there on, so documents stay apart across
  ranks too.

Gradients flow back through the same all-gathers (their backward is a reduce-scatter), so
autograd gives every rank its chunks' gradients without a hand-written backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn

from torchtitan.distributed.context_parallel import chunk_ids, unshard_sequence
from torchtitan.models.common.gated_deltanet import (
    causal_conv,
    document_starts,
    gated_delta_chunked,
)

__all__ = ["ContextParallelConv", "ContextParallelDeltaRule"]


def _gather_parts(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``x``, stacked in rank order (``[cp, ...]``); with autograd when ``x``
    requires it (the backward sums the gradients back onto their owners)."""
    cp = dist.get_world_size(group)
    if x.requires_grad:
        gathered = funcol.all_gather_tensor_autograd(x.contiguous(), 0, group)
    else:
        gathered = funcol.all_gather_tensor(x.contiguous(), 0, group)
    return funcol.wait_tensor(gathered).unflatten(0, (cp, x.shape[0]))


def _by_chunk(parts: torch.Tensor, cp: int) -> list[torch.Tensor]:
    """``parts [cp, 2, ...]`` (each rank's two chunks' pieces) as a list in sequence order."""
    found: dict[int, torch.Tensor] = {}
    for rank in range(cp):
        found.update(zip(chunk_ids(cp, rank), parts[rank]))
    return [found[i] for i in range(2 * cp)]


def _whole_doc_ids(doc_ids: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole sequence's document ids ``[B, T]`` from this rank's ``[B, T / cp]``."""
    cp = dist.get_world_size(group)
    return unshard_sequence(_gather_parts(doc_ids, group), cp, dim=1)


class ContextParallelConv(nn.Module):
    """The causal convolution of this rank's two chunks, each continued from the chunk before
    it in the sequence (whoever holds it)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        width, c = weight.shape[1] - 1, x.shape[1] // 2
        if width > c:
            raise ValueError(
                f"parallelism.context_parallel_degree: a chunk of {c} positions is shorter than "
                f"the convolution reads back ({width}); use a smaller degree or a longer sequence"
            )
        chunks = x.unflatten(1, (2, c))  # [B, 2, c, C]
        ends = _by_chunk(_gather_parts(chunks[:, :, c - width :].transpose(0, 1), self.group), cp)
        docs = None if doc_ids is None else doc_ids.unflatten(1, (2, c))
        doc_ends = None
        if doc_ids is not None:
            doc_ends = _by_chunk(
                _gather_parts(docs[:, :, c - width :].transpose(0, 1), self.group), cp
            )
        outs = []
        for slot, chunk in enumerate(chunk_ids(cp, rank)):
            tail = None if chunk == 0 else ends[chunk - 1]
            tail_docs = None if chunk == 0 or doc_ends is None else doc_ends[chunk - 1]
            mine = None if docs is None else docs[:, slot]
            outs.append(causal_conv(chunks[:, slot], weight, mine, tail, tail_docs))
        return torch.cat(outs, dim=1)


class ContextParallelDeltaRule(nn.Module):
    """The gated delta rule over this rank's two chunks, each starting from the state the whole
    sequence has there (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, chunk_size: int = 64) -> None:
        super().__init__()
        self.group = group
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
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        batch, t, heads, dk = k.shape
        dv, c = v.shape[-1], t // 2
        resets = None
        if doc_ids is not None:  # a start on a chunk's first position needs the one before it
            starts = document_starts(_whole_doc_ids(doc_ids, self.group))
            resets = [starts[:, i * c : (i + 1) * c] for i in chunk_ids(cp, rank)]
        # the identity's channels: an incoming state's reach, and each chunk's carry P
        v_ext = torch.cat([v.float(), v.new_zeros(batch, t, heads, dk, dtype=torch.float32)], -1)
        eye = torch.eye(dk, device=v.device).expand(batch, heads, dk, dk)
        start = torch.cat([eye.new_zeros(batch, heads, dk, dv), eye], dim=-1)
        outs, finals = [], []
        for slot in range(2):
            part = (x[:, slot * c : (slot + 1) * c] for x in (q, k, v_ext, g, beta))
            out, final = gated_delta_chunked(
                *part, self.chunk_size, state=start, resets=None if resets is None else resets[slot]
            )
            outs.append(out)
            finals.append(final)
        # every chunk's (W, P), in sequence order; the incoming state of each, folded in order
        carried = _by_chunk(_gather_parts(torch.stack(finals), self.group), cp)
        states, state = [], eye.new_zeros(batch, heads, dk, dv)
        for w_p in carried:
            states.append(state)
            state = w_p[..., :dv] + w_p[..., dv:] @ state  # S_out = W + P S_in
        result = []
        for slot, chunk in enumerate(chunk_ids(cp, rank)):
            o = outs[slot]
            reach = torch.einsum("bthk,bhkv->bthv", o[..., dv:], states[chunk])
            result.append((o[..., :dv] + reach).to(v.dtype))
        return torch.cat(result, dim=1)
