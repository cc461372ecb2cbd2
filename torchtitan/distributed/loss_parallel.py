"""The vocab-parallel loss of tensor parallelism, and the loss as training calls it: every
micro-batch's summed cross entropy over the valid tokens of the whole step."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config.schema import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.observability.log import logger


def uses_loss_parallel(dims: ParallelDims, job_config: JobConfig) -> bool:
    return dims.tp > 1 and not job_config.parallelism.disable_loss_parallel


def loss_context(dims: ParallelDims, job_config: JobConfig) -> contextlib.AbstractContextManager:
    """Forward-loss-backward runs inside this: the vocab-parallel loss needs ``loss_parallel()``."""
    return loss_parallel() if uses_loss_parallel(dims, job_config) else contextlib.nullcontext()


class TokenMeanLoss:
    """``loss(prediction, labels)``: the micro-batch's summed cross entropy divided by
    ``divisor``, which :meth:`StepRunner.begin_step` sets once per optimizer step to the valid
    (not ignored) labels of the whole global batch over the number of ranks whose gradients the
    data-parallel reduction averages (``dp x cp``).

    Summed over the micro-batches of a rank and averaged over those ranks, both the loss and the
    gradient are then the mean over every valid token of the step: exactly what one process
    computes on the whole batch, however unevenly the ignored labels fall across micro-batches
    and ranks (a mean of per-micro-batch means would weigh a token of a sparse micro-batch more).
    """

    def __init__(self, sum_loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.sum_loss = sum_loss
        self.divisor: float | torch.Tensor = 1.0

    def __call__(self, prediction: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.sum_loss(prediction, labels) / self.divisor


def build_loss_fn(
    loss_fn: Callable, dims: ParallelDims, job_config: JobConfig, parts: list[nn.Module]
) -> TokenMeanLoss:
    """The loss as training calls it, for this rank's model ``parts``: the family's ``loss_fn``
    summed over the micro-batch's valid tokens, inside a :class:`TokenMeanLoss`.

    With ``training.loss_chunks > 1`` the part holding the output projection (the last pipeline
    stage, or the whole model) stops at its final norm and the loss applies the projection and
    the cross entropy piece by piece (:class:`ChunkedOutputLoss`): the whole batch's logits never
    exist at once.

    Compiled when ``compile.components`` names the loss: the float32 upcast of the logits, the
    log-softmax and the gather fuse into a few kernels instead of materializing float32 logits
    (batch x seq x vocab) several times. The vocab-parallel loss (tensor parallel; DTensor logits
    under ``loss_parallel()``) stays eager.
    """
    # (imported here: importing torchtitan.models registers the families, which import this room)
    from torchtitan.models.common.loss import ChunkedOutputLoss

    n_chunks = job_config.training.loss_chunks
    last = next((p for p in parts if getattr(p, "output", None) is not None), None)
    sum_loss: Callable = functools.partial(loss_fn, reduction="sum")
    if n_chunks > 1 and last is not None:
        last.output_in_loss = True
        sum_loss = ChunkedOutputLoss(last.output, n_chunks, reduction="sum")
        logger.info(f"Output projection and loss computed in {n_chunks} pieces of the sequence")
    if not job_config.compile.compiles("loss"):
        return TokenMeanLoss(sum_loss)
    if uses_loss_parallel(dims, job_config):
        logger.info("Loss not compiled: the vocab-parallel loss of tensor parallelism stays eager")
        return TokenMeanLoss(sum_loss)
    logger.info("Compiled the loss with torch.compile")
    return TokenMeanLoss(torch.compile(sum_loss))
