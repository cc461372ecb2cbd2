"""The vocab-parallel loss of tensor parallelism, and the loss as training calls it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan.config_manager import JobConfig
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.log import logger


def uses_loss_parallel(dims: ParallelDims, job_config: JobConfig) -> bool:
    return dims.tp > 1 and not job_config.parallelism.disable_loss_parallel


def loss_context(dims: ParallelDims, job_config: JobConfig) -> contextlib.AbstractContextManager:
    """Forward-loss-backward runs inside this: the vocab-parallel loss needs ``loss_parallel()``."""
    return loss_parallel() if uses_loss_parallel(dims, job_config) else contextlib.nullcontext()


def build_loss_fn(
    loss_fn: Callable, dims: ParallelDims, job_config: JobConfig, parts: list[nn.Module]
) -> Callable:
    """The loss as training calls it, for this rank's model ``parts``.

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
    if n_chunks > 1 and last is not None:
        last.output_in_loss = True
        loss_fn = ChunkedOutputLoss(last.output, n_chunks)
        logger.info(f"Output projection and loss computed in {n_chunks} pieces of the sequence")
    if not job_config.compile.compiles("loss"):
        return loss_fn
    if uses_loss_parallel(dims, job_config):
        logger.info("Loss not compiled: the vocab-parallel loss of tensor parallelism stays eager")
        return loss_fn
    logger.info("Compiled the loss with torch.compile")
    return torch.compile(loss_fn)
