"""Optimizers: AdamW / Adam (fused, foreach or for-loop), one per model part, stepped together.

One optimizer per model part (a pipeline rank may hold several stages) lets the distributed
state-dict API key the optimizer state by parameter name (FQN) rather than by position, so a
checkpoint loads under another parallel layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.config_manager import Optimizer as OptimizerConfig
from torchtitan.log import logger


def _fused_supported(params: list[torch.Tensor]) -> bool:
    # Fused Adam(W) kernels exist for CUDA and (since torch 2.4) CPU; DTensor parameters work too.
    device_types = {p.device.type for p in params}
    return device_types <= {"cuda", "cpu", "xpu", "mps"}


def _build_one(params: list[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    impl = cfg.implementation
    if impl == "fused" and not _fused_supported(params):
        logger.info("optimizer.implementation: fused is not supported here; using foreach")
        impl = "foreach"
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return cls(params, **kwargs)


class Optimizers:
    """The optimizers of all model parts, used as one (``step``, ``zero_grad``, state dict)."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig) -> None:
        self.model_parts = model_parts
        self.optimizers = [
            _build_one([p for p in m.parameters() if p.requires_grad], cfg) for m in model_parts
        ]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad()

    def reset_state(self) -> None:
        """Forget every moment estimate and step count, as if freshly built."""
        for opt in self.optimizers:
            opt.state.clear()

    def state_dict(self) -> dict[str, Any]:
        """Flat ``{"state.<fqn>.<name>": tensor, "param_groups.<fqn>.<key>": value}`` of all parts."""
        state: dict[str, Any] = {}
        for model, opt in zip(self.model_parts, self.optimizers):
            state.update(get_optimizer_state_dict(model, opt, options=_FLAT))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part takes the entries of its own parameters."""
        for model, opt in zip(self.model_parts, self.optimizers):
            set_optimizer_state_dict(model, opt, state_dict, options=_FLAT)


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> Optimizers:
    """One optimizer per model part over its trainable parameters."""
    return Optimizers(model_parts, cfg)
