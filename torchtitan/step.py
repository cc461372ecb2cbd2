"""One local batch through the model, the same way for training and validation.

:meth:`StepRunner.forward_backward` (training) and :meth:`StepRunner.forward_loss` (validation,
no gradients) are the only places that know how a batch goes through the parallelized model:
moved to the device, cut to this rank's chunks of every sequence under context parallel, run
inside the vocab-parallel loss context under tensor parallel, through the pipeline schedule
(micro-batch by micro-batch, every pipeline rank getting the loss) or as a plain forward, and
under autocast where mixed precision comes from it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from torchtitan.config_manager import JobConfig
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.distributed.data_parallel import param_dtype
from torchtitan.distributed.loss_parallel import loss_context
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import device_type, full_tensor


def autocast_for(job_config: JobConfig, dims: ParallelDims) -> contextlib.AbstractContextManager:
    """Without FSDP (whose policy casts parameters), mixed precision on GPU comes from autocast."""
    dtype = param_dtype(job_config, device_type)
    if device_type == "cuda" and dtype != torch.float32 and not dims.fsdp_enabled:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


class StepRunner:
    """``model``: the first (or only) local part; ``pipeline``: the schedule over this rank's
    stages under pipeline parallelism, else None (forward and backward are then plain calls)."""

    def __init__(
        self,
        job_config: JobConfig,
        dims: ParallelDims,
        *,
        model: torch.nn.Module,
        pipeline: Any,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
    ) -> None:
        self.job_config, self.dims = job_config, dims
        self.model, self.pipeline, self.loss_fn, self.device = model, pipeline, loss_fn, device
        self.autocast = autocast_for(job_config, dims)

    def _local(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        if self.dims.cp > 1:  # this rank's chunks of every sequence
            cp, rank = self.dims.cp, self.dims.cp_rank
            inputs, labels = (shard_sequence(x, cp, rank) for x in (inputs, labels))
        return inputs, labels

    def forward_backward(
        self, inputs: torch.Tensor, labels: torch.Tensor, grad_accum_steps: int
    ) -> torch.Tensor:
        """Forward and backward of one local batch (gradients accumulate into ``.grad``); its
        loss divided by the accumulation steps, detached, on every rank of the batch."""
        inputs, labels = self._local(inputs, labels)
        with loss_context(self.dims, self.job_config):
            if self.pipeline is not None:  # the schedule runs forward and backward
                with self.autocast:
                    loss = self.pipeline.forward_backward(inputs, labels)
            else:
                with self.autocast:  # the forward only: backward runs outside autocast
                    loss = self.loss_fn(self.model(inputs), labels) / grad_accum_steps
                loss.backward()
        return full_tensor(loss.detach())  # a vocab-parallel loss is a DTensor

    def forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss of one local batch without gradients (float32, every rank)."""
        inputs, labels = self._local(inputs, labels)
        with torch.no_grad(), loss_context(self.dims, self.job_config), self.autocast:
            if self.pipeline is not None:
                return self.pipeline.forward_loss(inputs, labels)
            loss = self.loss_fn(self.model(inputs), labels)
        return full_tensor(loss).float()
