"""Guards that stop a run before a bad step is applied or saved."""

from __future__ import annotations

from typing import Any

import torch

from torchtitan.errors import TrainingDiverged


def stop_if_diverged(
    step: int, loss: torch.Tensor, grad_norm: torch.Tensor, checkpointer: Any
) -> None:
    """A non-finite gradient norm stops training before the optimizer step, so nothing from this
    step on is saved. The norm is already reduced over every rank and a non-finite loss on any
    rank makes it non-finite, so every rank decides alike with no collective: one host sync."""
    if torch.isfinite(grad_norm).item():
        return
    checkpointer.close()  # a background save of an earlier, good step is finished and marked
    newest = checkpointer.newest_complete()
    raise TrainingDiverged(
        f"step {step}: not finite: loss {float(loss):.6g} (this rank), gradient norm "
        f"{float(grad_norm):.6g}; training stopped before this step's optimizer step and nothing "
        f"from it on is saved (newest checkpoint: {newest or 'none'}). Lower optimizer.lr or "
        "raise lr_scheduler.warmup_steps, then resume"
    )
