"""The pretraining loss the families share, whole or chunk by chunk with the output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100  # F.cross_entropy's default: labels equal to it count in neither sum nor mean


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Next-token cross entropy, computed in float32: the mean over the positions whose label is
    not ``IGNORE_INDEX``, or with ``reduction="sum"`` their sum (training divides the sum by the
    valid tokens of the whole step, see ``distributed/loss_parallel.TokenMeanLoss``)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction=reduction)


class ChunkedOutputLoss(nn.Module):
    """``loss(hidden [B, T, dim], labels [B, T])``: the output projection and the mean cross
    entropy together, ``n_chunks`` pieces of the sequence at a time, never holding the logits of
    the whole batch.

    Each piece's logits (and their float32 copy and softmax) live only while that piece's loss is
    computed: the piece runs under activation checkpointing, so backward saves only the hidden
    states and recomputes the piece's logits when it gets there. Peak memory for the logits goes
    from ``B x T x vocab`` (plus its gradient) to ``B x T / n_chunks x vocab``; the price is one
    more forward of the output projection. The value is the cross entropy of the whole batch
    (``F.cross_entropy``'s mean over labels other than -100; with ``reduction="sum"`` their
    sum), up to summation order.

    ``output`` is the model's own output module, called once per piece (so a tensor-parallel plan
    on it applies as usual: vocab-sharded logits under the vocab-parallel loss); the model returns
    the final norm's output instead of logits (``Decoder.output_in_loss``). A module itself so
    that module trackers see the pieces' calls of ``output`` inside one parent call; it owns no
    parameters beyond the model's ``output``.
    """

    def __init__(self, output: nn.Module, n_chunks: int, reduction: str = "mean") -> None:
        super().__init__()
        if n_chunks < 1:
            raise ValueError(f"n_chunks: {n_chunks} must be >= 1")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction: {reduction!r} must be 'mean' or 'sum'")
        self.output, self.n_chunks, self.reduction = output, n_chunks, reduction

    def _piece(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.output(hidden).flatten(0, 1).float()
        return F.cross_entropy(logits, labels.flatten(0, 1), reduction="sum")

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pieces = zip(hidden.chunk(self.n_chunks, dim=1), labels.chunk(self.n_chunks, dim=1))
        total = sum(checkpoint(self._piece, h, y, use_reentrant=False) for h, y in pieces)
        if self.reduction == "sum":
            return total
        return total / (labels != IGNORE_INDEX).sum().clamp(min=1)
