"""What a checkpoint holds, as objects with ``state_dict`` / ``load_state_dict``: the step
counters, the model parts keyed by parameter FQN, and each rank's RNG states."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

STATE_KEYS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class TrainState:
    step: int = 0
    ntokens_seen: int = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.ntokens_seen = int(state["step"]), int(state["ntokens_seen"])


class ModelState:
    """The model parts (pipeline stages) as one state dict keyed by parameter FQN."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for part in self.parts:
            state.update(get_model_state_dict(part))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for part in self.parts:
            own = get_model_state_dict(part).keys()
            set_model_state_dict(part, {k: state[k] for k in own}, options=StateDictOptions())


class RNGState:
    """This rank's torch RNG states (CPU, and CUDA where present), keyed by global rank."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        return {self.key: state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = state.get(self.key)
        if not mine:
            return
        torch.set_rng_state(mine["cpu"])
        if "cuda" in mine and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["cuda"])
