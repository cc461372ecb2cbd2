"""The train-spec registry: everything train.py needs to know about one model family.

A model family registers one :class:`TrainSpec` (its model class, flavors, how to parallelize it,
its tokenizer, loss, optimizer, LR schedule and data loader builders). Adding a model, or swapping
its loss, touches only that model's folder and its registration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from torchtitan.errors import ConfigError


@dataclass(frozen=True)
class TrainSpec:
    name: str
    cls: type[nn.Module]
    flavors: dict[str, Any]
    parallelize_fn: Callable[..., nn.Module]
    build_tokenizer_fn: Callable[..., Any]
    build_dataloader_fn: Callable[..., Any]
    # (prediction, labels, reduction="mean" | "sum") -> loss; training calls it with "sum"
    loss_fn: Callable[..., Any]
    build_optimizer_fn: Callable[..., Any]
    build_lr_scheduler_fn: Callable[..., Any]
    nparams_and_flops_fn: Callable[..., tuple[int, int]]
    # (meta model, PipelinePlan, pp rank) -> {stage index: stage module}; None: no pipelining
    pipelining_fn: Callable[..., Any] | None = None
    # HFStateDictAdapter subclass (called with the model args); None: no Hugging Face exchange
    state_dict_adapter: type | None = None
    # (folder, tokenizer, max_seq_len) -> None: tokenizer files beside a Hugging Face export
    export_tokenizer_fn: Callable[..., None] | None = None


_REGISTRY: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"train spec '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec


def get_train_spec(name: str) -> TrainSpec:
    import torchtitan.models  # noqa: F401  (registers the built-in families)

    if name not in _REGISTRY:
        raise ConfigError(
            f"model.name: unknown model '{name}'; valid: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def spec_for_hf_config(config: dict, where: str) -> TrainSpec:
    """The registered family whose adapter reads this ``config.json`` (by its ``model_type``)."""
    import torchtitan.models  # noqa: F401  (registers the built-in families)

    model_type = config.get("model_type")
    for spec in _REGISTRY.values():
        adapter = spec.state_dict_adapter
        if adapter is not None and model_type in (adapter.model_type, *adapter.also_reads):
            return spec
    known = sorted(
        t
        for s in _REGISTRY.values()
        if s.state_dict_adapter
        for t in (s.state_dict_adapter.model_type, *s.state_dict_adapter.also_reads)
    )
    raise ConfigError(
        f"{where}: config.json model_type {model_type!r} is not a family this library builds; "
        f"valid: {', '.join(known)}"
    )


# Flavors upstream keeps in another family (its qwen3 holds the Qwen3-MoE sizes):
# (family, flavor) -> (family here, flavor here).
MOVED_FLAVORS: dict[tuple[str, str], tuple[str, str]] = {
    ("qwen3", "debugmodel_moe"): ("qwen3_moe", "debugmodel"),
    ("qwen3", "30B-A3B"): ("qwen3_moe", "30B-A3B"),
    ("qwen3", "235B-A22B"): ("qwen3_moe", "235B-A22B"),
}


def get_model_args(name: str, flavor: str) -> Any:
    spec = get_train_spec(name)
    if (name, flavor) in MOVED_FLAVORS:
        family, here = MOVED_FLAVORS[name, flavor]
        raise ConfigError(
            f"model.flavor: '{flavor}' is upstream's {name} mixture-of-experts flavor; here it is "
            f"model.name = '{family}' with model.flavor = '{here}'"
        )
    if flavor not in spec.flavors:
        raise ConfigError(
            f"model.flavor: '{flavor}' is not a flavor of {name}; valid: {', '.join(spec.flavors)}"
        )
    return spec.flavors[flavor]
