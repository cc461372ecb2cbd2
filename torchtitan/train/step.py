"""One local batch through the model, the same way for training and validation.

:meth:`StepRunner.forward_backward` (training) and :meth:`StepRunner.forward_loss` (validation,
no gradients) are the only places that know how a batch goes through the parallelized model:
moved to the device, cut to this rank's chunks of every sequence under context parallel (the
document ids of block-causal attention too), run inside the vocab-parallel loss context under
tensor parallel, through the pipeline schedule (micro-batch by micro-batch, every pipeline rank
getting the loss) or as a plain forward, and under autocast where mixed precision comes from it.
With multi-token prediction, training's labels carry each depth's targets
(:func:`~torchtitan.train.loss.mtp_targets`); validation scores the main head alone.

The loss of an optimizer step is the mean over the valid tokens of its whole global batch:
:meth:`StepRunner.step_tokens` counts them (one all-reduce) before the first micro-batch runs, and
every micro-batch's :meth:`StepRunner.forward_backward` gets the divisor as an argument.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.config.schema import JobConfig
from torchtitan.data.batch import IGNORE_INDEX, Batch
from torchtitan.distributed.context_parallel import shard_sequence
from torchtitan.distributed.data_parallel import param_dtype
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.utils import device_type, full_tensor
from torchtitan.train.loss import LossFn, MTPLoss, build_row_loss, loss_context, mtp_targets


def autocast_for(job_config: JobConfig, dims: ParallelDims) -> contextlib.AbstractContextManager:
    """Without FSDP (whose policy casts parameters), mixed precision on GPU comes from autocast."""
    dtype = param_dtype(job_config.training, device_type)
    if device_type == "cuda" and dtype != torch.float32 and not dims.uses_fully_shard:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class StepTokens:
    """The valid (not ignored) labels of an optimizer step's whole global batch, and what each
    micro-batch's summed loss is divided by: that count over the ranks that average gradients."""

    count: int
    divisor: float


class StepRunner:
    """``model``: the first (or only) local part; ``pipeline``: the schedule over this rank's
    stages under pipeline parallelism, else None (forward and backward are then plain calls);
    ``loss_fn``: the training loss (:data:`~torchtitan.train.loss.LossFn`)."""

    def __init__(
        self,
        job_config: JobConfig,
        dims: ParallelDims,
        *,
        model: torch.nn.Module,
        pipeline: Any,
        loss_fn: LossFn,
        device: torch.device,
    ) -> None:
        self.job_config, self.dims = job_config, dims
        self.model, self.pipeline, self.loss_fn, self.device = model, pipeline, loss_fn, device
        self.autocast = autocast_for(job_config, dims)
        self.block_causal = job_config.model.attn_mask_type == "block_causal"
        # this rank's model parts: the pipeline's stages, or the one model
        self.parts = pipeline.parts if pipeline is not None else [model]
        self.row_loss = build_row_loss(self.parts)

    def _local(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(inputs, labels, doc_ids)`` on the device, this rank's chunks of every sequence
        under context parallel; ``doc_ids`` only for block-causal attention."""
        tensors = [batch.inputs, batch.labels] + ([batch.doc_ids] if self.block_causal else [])
        tensors = [x.to(self.device) for x in tensors]
        if self.dims.cp > 1:  # this rank's chunks of every sequence
            tensors = [shard_sequence(x, self.dims.cp, self.dims.cp_rank) for x in tensors]
        inputs, labels, *doc_ids = tensors
        return inputs, labels, doc_ids[0] if doc_ids else None

    def step_tokens(self, batches: list[Batch]) -> StepTokens:
        """The valid labels of the optimizer step made of this rank's ``batches`` (its micro-
        batches) over the whole global batch (one all-reduce over the data-parallel ranks), and
        the divisor of every micro-batch's loss."""
        local = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
        count = torch.tensor(float(local), device=self.device)
        dp_mesh = self.dims.dp_mesh  # context-parallel ranks of a replica read the same batch
        if dp_mesh is not None and dp_mesh.size() > 1:
            dist.all_reduce(count, group=dp_mesh.get_group())
        loss_mesh = self.dims.loss_mesh
        averaged_over = loss_mesh.size() if loss_mesh is not None else 1
        return StepTokens(int(count), max(float(count), 1.0) / averaged_over)

    def forward_backward(self, batch: Batch, divisor: float) -> torch.Tensor:
        """Forward and backward of one micro-batch (gradients accumulate into ``.grad``); its
        loss (this rank's share of the step's token mean: the summed loss over ``divisor``, see
        :meth:`step_tokens`), detached, on every rank of the batch."""
        inputs, labels, doc_ids = self._local(batch)
        if isinstance(self.loss_fn, MTPLoss):  # each prediction depth's targets too
            labels = mtp_targets(labels, doc_ids, self.loss_fn.depths)
        with loss_context(self.dims, self.job_config):
            if self.pipeline is not None:  # the schedule runs forward and backward
                with self.autocast:
                    loss = self.pipeline.forward_backward(inputs, labels, doc_ids, divisor)
                pieces = self.pipeline.micro_batch_losses
            else:
                with self.autocast:  # the forward only: backward runs outside autocast
                    loss = self.loss_fn(self._forward(inputs, doc_ids), labels, divisor)
                loss.backward()
                pieces = [loss]
        if isinstance(self.loss_fn, MTPLoss):
            self.loss_fn.record(pieces)
        return full_tensor(loss.detach())  # a vocab-parallel loss is a DTensor

    def _forward(self, inputs: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        return self.model(inputs) if doc_ids is None else self.model(inputs, doc_ids=doc_ids)

    def forward_loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(summed loss, valid labels)`` of one local batch without gradients (float32, every
        rank; under context parallel, of this rank's chunks)."""
        inputs, labels, doc_ids = self._local(batch)
        count = (labels != IGNORE_INDEX).sum().float()
        with torch.no_grad(), loss_context(self.dims, self.job_config), self.autocast:
            if self.pipeline is not None:
                return self.pipeline.forward_loss(inputs, labels, doc_ids), count
            loss = self.loss_fn(self._forward(inputs, doc_ids), labels, 1.0)  # the sum
        return full_tensor(loss).float(), count

    def forward_row_loss(self, batch: Batch) -> torch.Tensor:
        """Each row's summed loss over its valid labels (``[rows]`` float32, minus the row's
        log-likelihood) without gradients, on every rank of the batch: whole under tensor
        parallel, summed over the context-parallel ranks' chunks, broadcast from the last
        pipeline stage."""
        inputs, labels, doc_ids = self._local(batch)
        with torch.no_grad(), loss_context(self.dims, self.job_config), self.autocast:
            if self.pipeline is not None:
                rows = self.pipeline.forward_rows(inputs, labels, doc_ids, self.row_loss)
            else:
                rows = full_tensor(self.row_loss(self._forward(inputs, doc_ids), labels))
        rows = rows.float()
        if self.dims.cp > 1:  # each rank scored its chunks of every row
            dist.all_reduce(rows, group=self.dims.sub("cp").get_group())
        return rows
