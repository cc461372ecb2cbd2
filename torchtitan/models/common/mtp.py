"""Multi-token prediction (DeepSeek-V3 technical report, arXiv:2412.19437, section 2.2): model
math only. Any family whose args say ``num_mtp_layers`` gets these from the decoder.

Depth ``k`` (1..D) at position ``i`` predicts token ``t[i + k + 1]`` from the depth before it
(the main model's output for ``k = 1``) and the embedding of ``t[i + k]``::

    h'_k = eh_proj(cat(enorm(Emb(t[i + k])), hnorm(h_{k-1})))     # embedding first
    h_k  = norm(block_k(h'_k))                                     # one transformer block

and the shared output head turns ``h_k`` into its logits. The order inside the concatenation is
the published checkpoints' (embedding, then hidden: DeepSeek's ``eh_proj`` weights,
``transformers``' ``MtpLayer``); the paper's equation 21 writes the other order. ``h_0`` is the
main model's final-norm output, the state its own head reads: what ``transformers``' MTP
drafting feeds the released weights (its ``hidden_states[-1]`` is the normed state). The
sequence is not lengthened: depth ``k``'s last ``k`` positions have no token to read (a zero
embedding) and no target.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from torchtitan.models.common.blocks import trunc_normal_

__all__ = ["MTPLayer", "roll_left"]


def roll_left(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """``x`` moved ``k`` places to the left along dim 1 (``out[:, i] = x[:, i + k]``), the last
    ``k`` places ``fill``."""
    if k == 0:
        return x
    tail = x.new_full((x.shape[0], min(k, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, k:], tail], dim=1)


class MTPLayer(nn.Module):
    """One prediction depth: ``forward(emb, prev, rope_cache, mask) -> h_k`` (see the module
    doc), ``emb`` already moved to this depth's tokens. ``block`` is the family's transformer
    block (called as the main ones are), ``build_norm`` makes each of the three norms."""

    def __init__(self, dim: int, block: nn.Module, build_norm: Any) -> None:
        super().__init__()
        self.enorm = build_norm()
        self.hnorm = build_norm()
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = build_norm()

    def forward(
        self, emb: torch.Tensor, prev: torch.Tensor, rope_cache: torch.Tensor, mask: Any = None
    ) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev)], dim=-1))
        return self.norm(self.block(h, rope_cache, mask))

    def init_weights(self) -> None:
        """Norms to one, ``eh_proj`` truncated normal std 0.02, the block as its own."""
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, std=0.02)
        self.block.init_weights()
