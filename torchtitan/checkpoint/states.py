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

from torchtitan.distributed.param_init import canonical_name

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
    """The model parts (pipeline stages) as one state dict keyed by parameter FQN.

    ``which``: ``"all"`` of it; ``"trainable"``: the parameters that train, and the buffers (a run
    with frozen parameters, LoRA, saves and resumes only those); ``"frozen"``: every entry but
    the trained parameters (what such a run loads from its base model, buffers included)."""

    def __init__(self, parts: list[nn.Module], which: str = "all") -> None:
        assert which in ("all", "trainable", "frozen"), which
        self.parts, self.which = parts, which

    def part_state(self, part: nn.Module) -> dict[str, Any]:
        if self.which == "trainable":
            return get_model_state_dict(part, options=StateDictOptions(ignore_frozen_params=True))
        state = get_model_state_dict(part)
        if self.which == "frozen":
            trained = trainable_keys(part)
            state = {k: v for k, v in state.items() if k not in trained}
        return state

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for part in self.parts:
            state.update(self.part_state(part))
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        options = StateDictOptions(strict=self.which == "all")
        for part in self.parts:
            own = self.part_state(part).keys()
            set_model_state_dict(part, {k: state[k] for k in own}, options=options)


def trainable_keys(part: nn.Module) -> set[str]:
    """The state-dict keys of ``part``'s parameters that train (``requires_grad``); buffers
    (an MoE layer's expert biases) are not among them: a base model holds them."""
    return {canonical_name(n) for n, p in part.named_parameters() if p.requires_grad}


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
