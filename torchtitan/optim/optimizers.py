"""Optimizers: AdamW / Adam (fused, foreach or for-loop), one per model part, stepped together;
with Muon (``torchtitan/optim/muon.py``) for the hidden matrices beside it.

Each part's parameters are in groups (``param_groups``): weight decay or none, and per-rule
learning-rate multipliers.

One optimizer per model part (a pipeline rank may hold several stages) lets the distributed
state-dict API key the optimizer state by parameter name (FQN) rather than by position, so a
checkpoint loads under another parallel layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan.config.schema import Optimizer as OptimizerConfig
from torchtitan.distributed.utils import stepped_grad_norms
from torchtitan.errors import ConfigError
from torchtitan.observability.log import logger
from torchtitan.optim.bf16_state import BF16StateAdam
from torchtitan.optim.muon import DistributedMuon
from torchtitan.optim.param_groups import Group, categories, for_muon, parse_rules, plan_groups


def _fused_supported(params: list[torch.Tensor]) -> bool:
    # Fused Adam(W) kernels exist for CUDA and (since torch 2.4) CPU; DTensor parameters work too.
    device_types = {p.device.type for p in params}
    return device_types <= {"cuda", "cpu", "xpu", "mps"}


def _build_adam(groups: list[Group], cfg: OptimizerConfig) -> torch.optim.Optimizer:
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
    param_groups = [
        {"params": g.params, "lr": cfg.lr * g.lr_multiplier, "weight_decay": g.weight_decay}
        for g in groups
    ]
    if cfg.state_dtype == "bfloat16":
        return BF16StateAdam(param_groups, decoupled=cfg.name != "Adam", **kwargs)
    cls = torch.optim.Adam if cfg.name == "Adam" else torch.optim.AdamW
    return cls(param_groups, **kwargs)


def _build_muon(groups: list[Group], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    param_groups = [
        {"params": g.params, "lr": cfg.muon_lr * g.lr_multiplier, "weight_decay": g.weight_decay}
        for g in groups
    ]
    return DistributedMuon(
        param_groups,
        lr=cfg.muon_lr,
        weight_decay=cfg.weight_decay,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        adjust_lr_fn=cfg.muon_adjust_lr,
        state_dtype=torch.bfloat16 if cfg.state_dtype == "bfloat16" else None,
    )


def _split_for_muon(model: nn.Module, groups: list[Group], part: int) -> list[Group]:
    """Each group split in two: the hidden matrices (2-D, or 3-D stacked experts, and no
    embedding, output, norm or bias) for Muon, the rest for AdamW."""
    kinds = categories(model)
    split: list[Group] = []
    for g in groups:
        for optimizer in ("AdamW", "Muon"):
            part_of = Group(g.lr_multiplier, g.weight_decay, optimizer=optimizer)
            for name, p in zip(g.names, g.params):
                if (optimizer == "Muon") == for_muon(kinds[name], p):
                    part_of.names.append(name)
                    part_of.params.append(p)
            if part_of.params:
                split.append(part_of)
    if not any(g.optimizer == "Muon" for g in split):
        names = ", ".join(n for g in groups for n in g.names[:3])
        raise ConfigError(
            f"optimizer.name: Muon, but model part {part} has no hidden matrices for it (only "
            f"{names or 'no trainable parameters'}); use AdamW, or split the pipeline so that "
            "every stage holds a transformer block"
        )
    return split


class Optimizers:
    """The optimizers of all model parts, used as one (``step``, ``zero_grad``, state dict).
    Per part: one AdamW (or Adam); with ``optimizer.name = "Muon"`` a Muon beside it for the
    hidden matrices."""

    def __init__(self, model_parts: list[nn.Module], cfg: OptimizerConfig) -> None:
        self.model_parts = model_parts
        self.rules = parse_rules(cfg.param_groups)
        self.rule_hits = [0] * len(self.rules)  # parameters each rule matched on this rank
        self.plans: list[list[Group]] = []  # each part's groups
        self.per_part: list[list[torch.optim.Optimizer]] = []
        self.groups_of: dict[int, list[Group]] = {}  # id(optimizer) -> its groups, in order
        for i, m in enumerate(model_parts):
            groups, hits = plan_groups(m, cfg.weight_decay, cfg.weight_decay_exempt, self.rules)
            self.rule_hits = [a + b for a, b in zip(self.rule_hits, hits)]
            if cfg.name == "Muon":
                groups = _split_for_muon(m, groups, i)
            self.plans.append(groups)
            adam = [g for g in groups if g.optimizer != "Muon"]
            muon = [g for g in groups if g.optimizer == "Muon"]
            built = [(_build_adam(adam, cfg), adam)] if adam else []
            built += [(_build_muon(muon, cfg), muon)] if muon else []
            self.per_part.append([opt for opt, _ in built])
            self.groups_of.update({id(opt): mine for opt, mine in built})
        self.optimizers = [opt for opts in self.per_part for opt in opts]
        self.betas, self.eps = (cfg.beta1, cfg.beta2), cfg.eps
        if cfg.early_step_in_backward:
            self._step_in_backward()

    def _step_in_backward(self) -> None:
        """``optimizer.early_step_in_backward``: each parameter is updated as soon as backward
        has its gradient (after FSDP's reduce-scatter under FSDP), by its part's optimizer
        stepped while it is the only parameter holding a gradient, and the gradient is freed at
        once (memory). The update is the one ``step()`` would make (the same state, groups and
        learning rate); its norm is kept for the step's logged gradient norm, but nothing can be
        clipped. ``step()`` and ``zero_grad()`` then find no gradients: no-ops."""

        def step_one(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
            stepped_grad_norms.add(param.grad)
            opt.step()
            param.grad = None

        for opt in self.optimizers:
            for group in opt.param_groups:
                for param in group["params"]:
                    param.register_post_accumulate_grad_hook(functools.partial(step_one, opt))
        logger.warning(
            "optimizer.early_step_in_backward: each parameter steps in backward; gradients are "
            "not clipped (training.max_norm has no effect), the logged grad_norm is unclipped"
        )

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
        for model, opts in zip(self.model_parts, self.per_part):
            state.update(get_optimizer_state_dict(model, opts, options=_FLAT))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part takes the entries of its own parameters: the moments and step counts. The
        groups' settings stay the configured ones (a checkpoint written with other groups, or
        before there were groups, would give a whole group the weight decay of its first
        parameter); the learning rate is the schedule's, set when the scheduler loads."""
        for model, opts in zip(self.model_parts, self.per_part):
            set_optimizer_state_dict(model, opts, state_dict, options=_FLAT)
            for opt in opts:
                for param_group, group in zip(opt.param_groups, self.groups_of[id(opt)]):
                    param_group["weight_decay"] = group.weight_decay
                    if "betas" in param_group:
                        param_group["betas"], param_group["eps"] = self.betas, self.eps


_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> Optimizers:
    """One optimizer per model part over its trainable parameters."""
    return Optimizers(model_parts, cfg)
