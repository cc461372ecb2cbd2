"""Optimizers: AdamW / Adam (fused, foreach or for-loop), one per model part, stepped together.

Each part's parameters are in groups (``param_groups``): weight decay or none, and per-rule
learning-rate multipliers.

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
from torchtitan.param_groups import Group, parse_rules, plan_groups


def _fused_supported(params: list[torch.Tensor]) -> bool:
    # Fused Adam(W) kernels exist for CUDA and (since torch 2.4) CPU; DTensor parameters work too.
    device_types = {p.device.type for p in params}
    return device_types <= {"cuda", "cpu", "xpu", "mps"}


def _build_one(groups: list[Group], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for g in groups for p in g.params]
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
    param_groups = [
        {"params": g.params, "lr": cfg.lr * g.lr_multiplier, "weight_decay": g.weight_decay}
        for g in groups
    ]
    return cls(param_groups, **kwargs)


class Optimizers:
    """The optimizers of all model parts, used as one (``step``, ``zero_grad``, state dict)."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig) -> None:
        self.model_parts = model_parts
        self.rules = parse_rules(cfg.param_groups)
        self.rule_hits = [0] * len(self.rules)  # parameters each rule matched on this rank
        self.plans: list[list[Group]] = []  # each part's groups
        for m in model_parts:
            groups, hits = plan_groups(m, cfg.weight_decay, cfg.weight_decay_exempt, self.rules)
            self.plans.append(groups)
            self.rule_hits = [a + b for a, b in zip(self.rule_hits, hits)]
        self.optimizers = [_build_one(groups, cfg) for groups in self.plans]
        self.betas, self.eps = (cfg.beta1, cfg.beta2), cfg.eps

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
        """Each part takes the entries of its own parameters: the moments and step counts. The
        groups' settings stay the configured ones (a checkpoint written with other groups, or
        before there were groups, would give a whole group the weight decay of its first
        parameter); the learning rate is the schedule's, set when the scheduler loads."""
        for model, opt, groups in zip(self.model_parts, self.optimizers, self.plans):
            set_optimizer_state_dict(model, opt, state_dict, options=_FLAT)
            for param_group, group in zip(opt.param_groups, groups):
                param_group["weight_decay"] = group.weight_decay
                param_group["betas"], param_group["eps"] = self.betas, self.eps


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> Optimizers:
    """One optimizer per model part over its trainable parameters."""
    return Optimizers(model_parts, cfg)
