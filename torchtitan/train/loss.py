"""The training loss, in one place: next-token cross entropy (whole, or chunk by chunk with the
output projection), the vocab-parallel context of tensor parallelism, and the loss as a step
calls it.

Training's loss of an optimizer step is the mean over the valid (not ``IGNORE_INDEX``) labels of
the whole global batch. Every call takes that step's divisor as an argument:
``loss(prediction, labels, divisor)`` is the micro-batch's summed cross entropy over ``divisor``
(the step's valid labels over the ranks whose gradients data parallelism averages, see
:meth:`~torchtitan.train.step.StepRunner.step_tokens`). Summed over a rank's micro-batches and
averaged over those ranks, loss and gradient are what one process computes on the whole batch,
however unevenly the ignored labels fall (a mean of per-micro-batch means would weigh a token of
a sparse micro-batch more). Validation calls the same loss with divisor 1 (the sum); nothing is
kept between calls, so the two cannot disturb each other.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from torchtitan.config.schema import JobConfig
from torchtitan.data.batch import IGNORE_INDEX
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import uses_loss_parallel
from torchtitan.observability.log import logger

# (prediction, labels, divisor) -> the summed cross entropy over divisor
LossFn = Callable[[torch.Tensor, torch.Tensor, "float | torch.Tensor"], torch.Tensor]


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    """Next-token cross entropy, computed in float32: the mean over the positions whose label is
    not ``IGNORE_INDEX``, or with ``reduction="sum"`` their sum."""
    flat_logits, flat_labels = logits.flatten(0, 1).float(), labels.flatten(0, 1)
    return F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX, reduction=reduction)


class ChunkedOutputLoss(nn.Module):
    """``loss(hidden [B, T, dim], labels [B, T])``: the output projection and the mean cross
    entropy together, ``n_chunks`` pieces of the sequence at a time, never holding the logits of
    the whole batch.

    Each piece's logits (and their float32 copy and softmax) live only while that piece's loss is
    computed: the piece runs under activation checkpointing, so backward saves only the hidden
    states and recomputes the piece's logits when it gets there. Peak memory for the logits goes
    from ``B x T x vocab`` (plus its gradient) to ``B x T / n_chunks x vocab``; the price is one
    more forward of the output projection. The value is the cross entropy of the whole batch
    (the mean over labels other than ``IGNORE_INDEX``; with ``reduction="sum"`` their sum), up
    to summation order.

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
        return cross_entropy_loss(self.output(hidden), labels, reduction="sum")

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pieces = zip(hidden.chunk(self.n_chunks, dim=1), labels.chunk(self.n_chunks, dim=1))
        total = sum(checkpoint(self._piece, h, y, use_reentrant=False) for h, y in pieces)
        if self.reduction == "sum":
            return total
        return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def loss_context(dims: ParallelDims, job_config: JobConfig) -> contextlib.AbstractContextManager:
    """Forward-loss-backward runs inside this: the vocab-parallel loss needs ``loss_parallel()``."""
    if uses_loss_parallel(dims, job_config.parallelism):
        return loss_parallel()
    return contextlib.nullcontext()


def token_mean(sum_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> LossFn:
    """The loss as a step calls it: ``sum_loss`` (a micro-batch's summed cross entropy) over the
    step's ``divisor``."""

    def loss(prediction: torch.Tensor, labels: torch.Tensor, divisor: float | torch.Tensor):
        return sum_loss(prediction, labels) / divisor

    return loss


def build_loss_fn(dims: ParallelDims, job_config: JobConfig, parts: list[nn.Module]) -> LossFn:
    """The loss as training calls it, for this rank's model ``parts`` (:data:`LossFn`).

    With ``training.loss_chunks > 1`` the part holding the output projection (the last pipeline
    stage, or the whole model) stops at its final norm and the loss applies the projection and
    the cross entropy piece by piece (:class:`ChunkedOutputLoss`): the whole batch's logits never
    exist at once.

    Compiled when ``compile.components`` names the loss: the float32 upcast of the logits, the
    log-softmax and the gather fuse into a few kernels instead of materializing float32 logits
    (batch x seq x vocab) several times. The vocab-parallel loss (tensor parallel; DTensor logits
    under ``loss_parallel()``) stays eager.
    """
    n_chunks = job_config.training.loss_chunks
    last = next((p for p in parts if getattr(p, "output", None) is not None), None)
    sum_loss: Callable = functools.partial(cross_entropy_loss, reduction="sum")
    if n_chunks > 1 and last is not None:
        last.output_in_loss = True
        sum_loss = ChunkedOutputLoss(last.output, n_chunks, reduction="sum")
        logger.info(f"Output projection and loss computed in {n_chunks} pieces of the sequence")
    if not job_config.compile.compiles("loss"):
        return token_mean(sum_loss)
    if uses_loss_parallel(dims, job_config.parallelism):
        logger.info("Loss not compiled: the vocab-parallel loss of tensor parallelism stays eager")
        return token_mean(sum_loss)
    logger.info("Compiled the loss with torch.compile")
    return token_mean(torch.compile(sum_loss))
