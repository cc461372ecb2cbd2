"""Turning a model into a LoRA model: the linear layers named by ``lora.target_modules`` become
:class:`~torchtitan.lora.layers.LoRALinear`, and every other parameter is frozen.

Done on the meta device, before any parallelism (like the float8 conversion), so that FSDP, TP
and pipeline stages see the adapters as ordinary parameters of their blocks.

A pattern of ``lora.target_modules`` is a glob over a module's name in the model
(``layers.*.attention.wqkv``); one without a dot also matches the last part of the name
(``wqkv`` matches every ``layers.N.attention.wqkv``), as ``peft``'s ``target_modules`` does.
Only ``nn.Linear`` layers can be adapted; the routed experts of a mixture of experts (stacked
weights, not linear layers) cannot.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn

from torchtitan.errors import ConfigError
from torchtitan.lora.layers import LoRALinear


@dataclass(frozen=True)
class LoRASummary:
    """What :func:`apply_lora` did: the adapted module names, and the parameter counts."""

    modules: tuple[str, ...]
    trainable: int
    total: int

    def describe(self, rank: int, alpha: float) -> str:
        kinds = sorted({m.rsplit(".", 1)[-1] for m in self.modules})
        return (
            f"LoRA rank {rank}, alpha {alpha:g} on {len(self.modules)} linear layers "
            f"({', '.join(kinds)}): {self.trainable:,} trainable parameters of "
            f"{self.total:,} ({100 * self.trainable / self.total:.2f}%), the rest frozen"
        )


def matches(name: str, patterns: list[str]) -> bool:
    return any(
        fnmatch.fnmatchcase(name, p)
        or ("." not in p and fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], p))
        for p in patterns
    )


def apply_lora(
    model: nn.Module, *, rank: int, alpha: float, dropout: float, target_modules: list[str]
) -> LoRASummary:
    """Adapt the matching linear layers of ``model`` in place and freeze the rest; a one-line
    ConfigError when a pattern matches no linear layer."""
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    chosen = [n for n in linears if matches(n, target_modules)]
    unmatched = [p for p in target_modules if not any(matches(n, [p]) for n in linears)]
    if unmatched or not chosen:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise ConfigError(
            f"lora.target_modules: {unmatched or target_modules} match(es) no linear layer of "
            f"this model; its linear layers are named {', '.join(kinds)} (e.g. "
            f"{next(iter(linears), 'none')}); give globs over those names"
        )
    shared = _shared_weights(model)
    tied = [n for n in chosen if id(linears[n].weight) in shared]
    if tied:
        raise ConfigError(
            f"lora.target_modules: {tied[0]} shares its weight with "
            f"{shared[id(linears[tied[0]].weight)]} (tied embeddings), so its adapter could not "
            "be exported; leave it out of the targets"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        lora = LoRALinear.around(linears[name], rank=rank, alpha=alpha, dropout=dropout)
        lora.weight.requires_grad_(False)
        if lora.bias is not None:
            lora.bias.requires_grad_(False)
        setattr(parent, leaf, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return LoRASummary(tuple(chosen), trainable, total)


def _shared_weights(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): a module name}`` of the parameters held by more than one module."""
    seen: dict[int, str] = {}
    shared: dict[int, str] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen and seen[id(p)] != name:
                shared[id(p)] = seen[id(p)]
            seen.setdefault(id(p), name)
    return shared


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The LoRA layers of ``model`` (or of a pipeline stage) by name (wrapper prefixes kept)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
