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
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from torchtitan.config.schema import JobConfig
from torchtitan.data.batch import IGNORE_INDEX
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import uses_loss_parallel
from torchtitan.distributed.utils import full_tensor
from torchtitan.models.common.mtp import roll_left
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


def mtp_targets(labels: torch.Tensor, doc_ids: torch.Tensor | None, depths: int) -> torch.Tensor:
    """``[B, 1 + depths, T]``: the labels, then each multi-token-prediction depth ``k``'s
    targets (the labels moved ``k`` places left, the last ``k`` ignored). With ``doc_ids``
    (block-causal attention) a target from another document than its position is ignored too:
    depth ``k`` at the end of a document would otherwise predict the next one's tokens."""
    rows = [labels]
    for k in range(1, depths + 1):
        target = roll_left(labels, k, IGNORE_INDEX)
        if doc_ids is not None:
            target = target.masked_fill(roll_left(doc_ids, k, -1) != doc_ids, IGNORE_INDEX)
        rows.append(target)
    return torch.stack(rows, dim=1)


class MTPLoss:
    """The training loss with multi-token prediction (:data:`LossFn`): ``prediction`` holds
    ``1 + depths`` batches on dim 0 (``Decoder.forward`` with ``mtp_active``), ``targets`` is
    :func:`mtp_targets`' ``[B, 1 + depths, T]``. Its value is the main next-token loss, what
    every other model logs; its gradient is the main loss's plus ``weight`` times the mean of
    the depths' losses (DeepSeek-V3, arXiv:2412.19437, equation 25: each depth's cross entropy
    over the same divisor as the main one, the paper's 1/T). Plain ``[B, T]`` labels
    (validation) give the main loss alone.

    The depths' mean loss rides on the returned tensor (``mtp_loss``); the step runner adds each
    micro-batch's with :meth:`record` (:meth:`begin_step` zeroes the sum) for :meth:`metrics`."""

    def __init__(self, loss_fn: LossFn, depths: int, weight: float, holds_head: bool) -> None:
        self.loss_fn, self.depths, self.weight, self.holds_head = (
            loss_fn,
            depths,
            weight,
            holds_head,
        )
        self.step_sum: torch.Tensor | float = 0.0

    def __call__(
        self, prediction: torch.Tensor, targets: torch.Tensor, divisor: float | torch.Tensor
    ) -> torch.Tensor:
        pieces = prediction.chunk(1 + self.depths)
        if targets.ndim == 2:
            return self.loss_fn(pieces[0], targets, divisor)
        main = self.loss_fn(pieces[0], targets[:, 0], divisor)
        depths = range(1, self.depths + 1)
        mtp = sum(self.loss_fn(pieces[k], targets[:, k], divisor) for k in depths) / self.depths
        loss = main + self.weight * (mtp - mtp.detach())  # the value stays the main loss's
        loss.mtp_loss = mtp.detach()  # for :meth:`record` (the pipeline keeps the tensor)
        return loss

    def record(self, losses: list[torch.Tensor]) -> None:
        """Add the depths' losses carried by a step's micro-batch ``losses`` (what this object
        returned; not every call: the pipeline also calls it once to infer shapes)."""
        for loss in losses:
            mtp = getattr(loss, "mtp_loss", None)
            if mtp is not None:
                self.step_sum = self.step_sum + full_tensor(mtp).float()

    def begin_step(self) -> None:
        self.step_sum = 0.0

    def metrics(self, device: torch.device) -> dict[str, float]:
        """``{"mtp/loss": the step's mean depth loss}``, averaged over the ranks that computed
        it (the last pipeline stage's); every rank calls it (one all-reduce)."""
        held = float(self.holds_head)
        pair = torch.tensor([float(self.step_sum) * held, held], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(pair)
        return {"mtp/loss": float(pair[0] / pair[1].clamp(min=1))}


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
        loss_fn = token_mean(sum_loss)
    elif uses_loss_parallel(dims, job_config.parallelism):
        logger.info("Loss not compiled: the vocab-parallel loss of tensor parallelism stays eager")
        loss_fn = token_mean(sum_loss)
    else:
        logger.info(f"Compiled the loss with {job_config.compile.described()}")
        loss_fn = token_mean(torch.compile(sum_loss, backend=job_config.compile.backend))
    depths = mtp_depths(parts)
    if not depths:
        return loss_fn
    for part in parts:  # every stage: the ones before the last pass the embeddings on
        part.mtp_active = True
    weight = job_config.training.mtp_loss_weight
    logger.info(
        f"Multi-token prediction: {depths} depth(s), training.mtp_loss_weight {weight} times "
        "their mean loss in the objective (logged as mtp/loss)"
    )
    return MTPLoss(loss_fn, depths, weight, holds_head=last is not None)


def build_row_loss(parts: list[nn.Module]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``row_loss(prediction, labels) -> [B]``: each row's summed cross entropy over its valid
    labels (minus its log-likelihood; evaluation's scoring), for what this rank's ``parts``
    return: the main head's logits of a model with prediction depths, the logits of the final
    norm's output where the loss applies the output projection (``training.loss_chunks``), a
    vocab-parallel DTensor under tensor parallel (a DTensor comes back)."""
    depths = mtp_depths(parts)
    last = next((p for p in parts if getattr(p, "output", None) is not None), None)

    def row_loss(prediction: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if depths:
            prediction = prediction.chunk(1 + depths)[0]
        if last is not None and getattr(last, "output_in_loss", False):
            prediction = last.output(prediction)
        flat = prediction.flatten(0, 1).float()
        per_token = F.cross_entropy(
            flat, labels.flatten(0, 1), ignore_index=IGNORE_INDEX, reduction="none"
        )
        return per_token.view(labels.shape).sum(1)

    return row_loss


def mtp_depths(parts: list[nn.Module]) -> int:
    """The model's multi-token-prediction depths (0: none), from its args (every stage's)."""
    args = getattr(parts[0], "args", None) if parts else None
    return getattr(args, "num_mtp_layers", 0)
