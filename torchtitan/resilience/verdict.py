"""What a guard decides at a step boundary. The guards (non-finite, loss spike, preemption) only
decide; the loop acts on the verdict (``train/loop.py``: skip the update, or save this step or
close the checkpointer, then stop with the verdict's error)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torchtitan.errors import TorchTitanError, TrainingDiverged


class Action(enum.Enum):
    GO_ON = "go on"
    SKIP_UPDATE = "skip this update"
    STOP = "stop"


@dataclass(frozen=True)
class Verdict:
    """``action``; for a stop, the error's first words (``reason``), what to do next
    (``advice``), whether this step is saved first (``save``: a preemption or Ctrl-C) rather
    than nothing from it on (a divergence), and the error class the run exits with."""

    action: Action
    reason: str = ""
    advice: str = ""
    save: bool = False
    error: type[TorchTitanError] = TrainingDiverged
    # False: every rank judged the same numbers; None: the error class's own default
    names_rank: bool | None = None

    @property
    def stops(self) -> bool:
        return self.action is Action.STOP


GO_ON = Verdict(Action.GO_ON)
SKIP_UPDATE = Verdict(Action.SKIP_UPDATE)
