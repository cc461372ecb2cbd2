"""Guards that stop a run before a bad step is applied or saved."""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

import torch

from torchtitan.errors import TrainingDiverged
from torchtitan.observability.log import logger


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


class LossSpikeGuard:
    """Skips the optimizer update of a step whose loss spikes (``resilience.loss_spike_*``).

    A step's loss (the global one: every rank decides alike) is a spike when it is more than
    ``zscore`` standard deviations (taken as at least 1% of the mean) above the mean of the last
    ``window`` accepted steps, once
    ``warmup`` steps have been accepted; a spike is not added to that history. After
    ``max_consecutive`` spikes in a row the run stops (:class:`TrainingDiverged`): the model has
    moved somewhere its data keeps surprising it, which skipping cannot mend.
    """

    def __init__(self, zscore: float, window: int, warmup: int, max_consecutive: int) -> None:
        self.enabled = zscore > 0
        self.zscore, self.warmup, self.max_consecutive = zscore, warmup, max_consecutive
        self.history: deque[float] = deque(maxlen=window)
        self.consecutive = 0
        self.skipped = 0  # in this run

    def skips(self, step: int, loss: float, position: str, checkpointer: Any) -> bool:
        """Whether ``step``'s update is skipped; logs the spike with the batch's ``position``."""
        if not self.enabled:
            return False
        if len(self.history) >= self.warmup:
            mean = statistics.fmean(self.history)
            # at least 1% of the mean: on a flat stretch a tiny deviation would make noise a spike
            std = max(statistics.pstdev(self.history), 0.01 * abs(mean))
            z = (loss - mean) / std if std > 0 else 0.0
            if z > self.zscore:
                self.consecutive += 1
                self.skipped += 1
                logger.warning(
                    f"step {step}: loss spike {loss:.4f} ({z:.1f} standard deviations above the "
                    f"mean {mean:.4f} of the last {len(self.history)} steps): update skipped "
                    f"({self.skipped} skipped in this run); the batch: {position}"
                )
                if self.consecutive >= self.max_consecutive:
                    self._stop(step, checkpointer)
                return True
        self.consecutive = 0
        self.history.append(loss)
        return False

    def _stop(self, step: int, checkpointer: Any) -> None:
        checkpointer.close()  # a background save of an earlier, accepted step is marked complete
        first = step - self.consecutive + 1
        error = TrainingDiverged(
            f"steps {first}-{step}: {self.consecutive} loss spikes in a row "
            f"(resilience.loss_spike_max_consecutive = {self.max_consecutive}); training stopped "
            f"and nothing from these steps is saved (newest checkpoint: "
            f"{checkpointer.newest_complete() or 'none'}). Look at those batches (logged above), "
            "lower optimizer.lr, or raise resilience.loss_spike_zscore, then resume"
        )
        error.names_rank = False  # every rank judges the same loss (averaged over ranks)
        raise error
