"""Guards that judge a step before its update is applied or saved: a non-finite gradient norm
stops the run, a loss spike skips the update (and too many in a row stop it). Each returns a
:class:`~torchtitan.resilience.verdict.Verdict`; the loop acts on it."""

from __future__ import annotations

import statistics
from collections import deque

import torch

from torchtitan.observability.log import logger
from torchtitan.resilience.verdict import GO_ON, SKIP_UPDATE, Action, Verdict


def finite_verdict(step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Verdict:
    """A non-finite gradient norm stops training before the optimizer step, so nothing from this
    step on is saved. The norm is already reduced over every rank and a non-finite loss on any
    rank makes it non-finite, so every rank decides alike with no collective: one host sync."""
    if torch.isfinite(grad_norm).item():
        return GO_ON
    return Verdict(
        Action.STOP,
        reason=f"step {step}: not finite: loss {float(loss):.6g} (this rank), gradient norm "
        f"{float(grad_norm):.6g}; training stopped before this step's optimizer step and nothing "
        "from it on is saved",
        advice="Lower optimizer.lr or raise lr_scheduler.warmup_steps, then resume",
    )


class LossSpikeGuard:
    """Skips the optimizer update of a step whose loss spikes (``resilience.loss_spike_*``).

    A step's loss (the global one: every rank decides alike) is a spike when it is more than
    ``zscore`` standard deviations (taken as at least 1% of the mean) above the mean of the last
    ``window`` accepted steps, once
    ``warmup`` steps have been accepted; a spike is not added to that history. After
    ``max_consecutive`` spikes in a row the verdict is a stop (``TrainingDiverged``): the model has
    moved somewhere its data keeps surprising it, which skipping cannot mend.
    """

    def __init__(self, zscore: float, window: int, warmup: int, max_consecutive: int) -> None:
        self.enabled = zscore > 0
        self.zscore, self.warmup, self.max_consecutive = zscore, warmup, max_consecutive
        self.history: deque[float] = deque(maxlen=window)
        self.consecutive = 0
        self.skipped = 0  # in this run

    def verdict(self, step: int, loss: float, position: str) -> Verdict:
        """Go on, skip ``step``'s update (the spike is logged with the batch's ``position``), or
        stop after too many spikes in a row."""
        if not self.enabled:
            return GO_ON
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
                    return self._stop(step)
                return SKIP_UPDATE
        self.consecutive = 0
        self.history.append(loss)
        return GO_ON

    def _stop(self, step: int) -> Verdict:
        first = step - self.consecutive + 1
        return Verdict(
            Action.STOP,
            reason=f"steps {first}-{step}: {self.consecutive} loss spikes in a row "
            f"(resilience.loss_spike_max_consecutive = {self.max_consecutive}); training stopped "
            "and nothing from these steps is saved",
            advice="Look at those batches (logged above), lower optimizer.lr, or raise "
            "resilience.loss_spike_zscore, then resume",
            names_rank=False,  # every rank judges the same loss (averaged over ranks)
        )
