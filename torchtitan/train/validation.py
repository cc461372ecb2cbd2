"""Held-out loss and perplexity every ``validation.freq`` steps, under any parallel layout.

Each evaluation reads the validation data from its beginning: ``validation.steps`` batches per
data-parallel rank, or with -1 the whole of it (every rank stops when the first one runs out,
so all take part in the same collectives). Batches go through the model as in training (the
sequence split under context parallel, the vocab-parallel loss under TP, the pipeline schedule
forward-only under PP) without gradients. The loss is the mean over every valid (not ignored)
label of the pass, over all the ranks that hold different tokens (data and context parallel);
perplexity is its exponential.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.config.schema import JobConfig
from torchtitan.train.step import StepRunner


class Validator:
    """Runs batches through the training step runner, forward only."""

    def __init__(self, job_config: JobConfig, *, dataloader: Any, runner: StepRunner) -> None:
        self.job_config, self.cfg = job_config, job_config.validation
        self.dataloader, self.runner = dataloader, runner
        self.model, self.device = runner.model, runner.device
        self.loss_mesh = runner.dims.loss_mesh

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0 or step == self.job_config.training.steps

    def run(self) -> tuple[float, float, int, float]:
        """``(loss, perplexity, batches, seconds)`` of one pass over the validation data."""
        t0 = time.perf_counter()
        self.dataloader.restart()
        batches, totals = 0, torch.zeros(2, device=self.device)  # summed loss, valid labels
        was_training = self.model.training
        self.model.eval()
        for batch in self._batches():
            totals += torch.stack(self.runner.forward_loss(batch))
            batches += 1
        self.model.train(was_training)
        if batches == 0:
            raise ValueError("no validation batch")  # preflight's row check makes this unreachable
        if self.loss_mesh is not None and self.loss_mesh.size() > 1:
            dist.all_reduce(totals, group=self.loss_mesh.get_group())
        value = float(totals[0] / totals[1].clamp(min=1))
        return value, math.exp(min(value, 700.0)), batches, time.perf_counter() - t0

    def _batches(self):
        """This rank's batches, as many as every rank has (and at most ``validation.steps``)."""
        iterator = iter(self.dataloader)
        n = 0
        while self.cfg.steps < 0 or n < self.cfg.steps:
            batch = next(iterator, None)
            have = torch.tensor(0.0 if batch is None else 1.0, device=self.device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(have, op=dist.ReduceOp.MIN)
            if not have.item():
                return
            n += 1
            yield batch
