"""The model spec: what only a model family knows, and the registry of families.

A family registers one :class:`ModelSpec`: its model class, flavors, the tensor-parallel plan of
one block, its pipeline split and its Hugging Face adapter where they differ from the shared
ones. Everything else a run builds (tokenizer, data loader, loss, optimizer, LR schedule) is the
trainer's and the same for every family (``torchtitan/train/builders.py``). Adding a family is one
folder under ``models/`` and one :func:`register_model_spec` call in its ``__init__.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from torchtitan.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cls: type[nn.Module]
    flavors: Mapping[str, Any]
    # the Hugging Face state-dict adapter class (called with the model args); None: no exchange
    state_dict_adapter: type | None = None
    # styles -> {submodule: TP style} of one block; None: the shared decoder block plan
    # (``distributed/tensor_parallel.decoder_block_plan``)
    block_plan: Callable[[Any], dict[str, Any]] | None = None
    # (meta model, PipelinePlan, pp rank) -> {stage index: stage module}; None: the shared
    # decoder split (``distributed/pipeline.split_model``)
    pipeline_split: Callable[..., dict[int, nn.Module]] | None = None
    # (model, args, seq_len) -> (parameters, training FLOPs per token); None: the decoder's
    # (``models/common/decoder.get_nparams_and_flops``)
    nparams_and_flops: Callable[..., tuple[int, int]] | None = None
    # parallelism degrees this family cannot use yet: ``ParallelDims`` field ("tp", "cp", ...)
    # -> why; preflight refuses a degree above 1 with that reason
    not_yet: Mapping[str, str] = field(default_factory=dict)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"model spec '{spec.name}' is already registered")
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    import torchtitan.models  # noqa: F401  (registers the built-in families)

    if name not in _REGISTRY:
        raise ConfigError(
            f"model.name: unknown model '{name}'; valid: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def spec_for_hf_config(config: dict, where: str) -> ModelSpec:
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
    spec = get_model_spec(name)
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
