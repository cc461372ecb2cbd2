"""Learning-rate schedule: linear warm-up, a stable phase, then linear / sqrt / cosine decay.

``lr_factor(step)`` is the multiplier on ``optimizer.lr`` *for* optimizer step ``step`` (1-based):
- warm-up, steps 1..W: ``step / (W + 1)`` (never zero, so step 1 already learns);
- stable: 1.0 until the decay phase starts;
- decay over the last ``D = round(decay_ratio * (steps - W))`` steps (all post-warm-up steps when
  ``decay_ratio`` is unset): progress ``p`` goes from ``1/D`` to 1 and the factor from 1 down to
  ``min_lr_factor``: linear ``1 - p``, sqrt ``1 - sqrt(p)``, cosine ``(1 + cos(pi p)) / 2``, scaled
  as ``min + (1 - min) * curve``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from torchtitan.config.schema import LRScheduler as LRConfig


def lr_factor(step: int, *, total_steps: int, cfg: LRConfig) -> float:
    warmup = min(cfg.warmup_steps, total_steps)
    if step <= warmup:
        return step / (warmup + 1)
    remaining = total_steps - warmup
    decay_steps = remaining if cfg.decay_ratio is None else round(cfg.decay_ratio * remaining)
    decay_start = total_steps - decay_steps
    if step <= decay_start or decay_steps == 0:
        return 1.0
    p = min((step - decay_start) / decay_steps, 1.0)
    if cfg.decay_type == "linear":
        curve = 1.0 - p
    elif cfg.decay_type == "sqrt":
        curve = 1.0 - math.sqrt(p)
    else:
        curve = 0.5 * (1.0 + math.cos(math.pi * p))
    return cfg.min_lr_factor + (1.0 - cfg.min_lr_factor) * curve


class LRSchedulers:
    """One LambdaLR per optimizer of an ``Optimizers``, stepped together; all share the schedule."""

    def __init__(self, schedulers: list[torch.optim.lr_scheduler.LambdaLR]) -> None:
        self.schedulers = schedulers

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    def get_last_lr(self) -> list[float]:
        return self.schedulers[0].get_last_lr()

    def factor(self) -> float:
        """The schedule's multiplier for the next optimizer step (``lr_factor``)."""
        s = self.schedulers[0]
        return s.lr_lambdas[0](s.last_epoch)

    def state_dict(self) -> dict[str, Any]:
        """``{"last_epoch": finished optimizer steps}``: the schedule itself comes from config."""
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for s in self.schedulers:
            s.last_epoch = state_dict["last_epoch"]
            lrs = [base * lmbda(s.last_epoch) for base, lmbda in zip(s.base_lrs, s.lr_lambdas)]
            for group, lr in zip(s.optimizer.param_groups, lrs):
                group["lr"] = lr
            s._last_lr = lrs


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer], cfg: LRConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR | LRSchedulers:
    """A LambdaLR whose ``last_epoch`` counts finished optimizer steps (so resume restores it);
    for a list of optimizers (``Optimizers.optimizers``), one each in an ``LRSchedulers``."""
    if isinstance(optimizer, list):
        return LRSchedulers([build_lr_scheduler(o, cfg, total_steps) for o in optimizer])
    # LambdaLR evaluates the lambda at last_epoch = 0 on construction (before step 1) and after each
    # scheduler.step(); we want the value for the *next* optimizer step, hence ``n + 1``.
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda n: lr_factor(n + 1, total_steps=total_steps, cfg=cfg)
    )
