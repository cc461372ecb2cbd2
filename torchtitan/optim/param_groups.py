"""Parameter groups: which parameters get weight decay, and per-rule learning-rate multipliers.

Every trainable parameter falls in at most one category, decided from the model alone (no model
family is named here):

- ``embeddings``: the parameters of ``nn.Embedding`` modules (the token table; a tied output
  projection is the same tensor and counts here);
- ``output``: the parameters of a ``nn.Linear`` that is a direct child of the model (the final
  projection to the vocabulary in every family here);
- ``biases``: parameters named ``*.bias`` or ``*_bias`` (stacked experts' biases), and the
  attention sinks (``*.sinks``, a learned logit per head);
- ``norms``: the other one-dimensional parameters (RMSNorm and LayerNorm weights, q/k norms).

``optimizer.weight_decay_exempt`` lists the categories that get no weight decay (default: norms,
biases, embeddings, as GPT-3, Llama and OLMo train). ``optimizer.param_groups`` rules then give
the parameters whose names match a glob (``fnmatch``, on the names of the unwrapped model,
``layers.3.attention.wqkv.weight``) their own ``lr_multiplier`` and/or ``weight_decay``. The
parameters with the same settings form one ``torch.optim`` group. The optimizer's state dict is
keyed by parameter name, so the groups survive a resume under another parallel layout.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
import torch.nn as nn

from torchtitan.errors import ConfigError
from torchtitan.observability.log import logger

CATEGORIES = ("norms", "biases", "embeddings", "output")
_RULE_KEYS = ("match", "lr_multiplier", "weight_decay")
# wrappers that torch.compile and activation checkpointing put into parameter names
_WRAPPER_PARTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


@dataclass(frozen=True)
class Rule:
    """``[[optimizer.param_groups]]`` entry ``index`` (from 0)."""

    index: int
    match: str
    lr_multiplier: float | None = None
    weight_decay: float | None = None

    def describe(self) -> str:
        return f"optimizer.param_groups[{self.index}] (match '{self.match}')"


def parse_rules(raw: Any) -> list[Rule]:
    """The rules of ``optimizer.param_groups`` (TOML tables, or JSON text from the command line);
    a ConfigError names the first bad entry and what would be valid."""
    if raw is None:
        return []
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"optimizer.param_groups: not JSON ({e.msg}); give a list of tables such as "
                '[{"match": "layers.*.attention.*", "lr_multiplier": 0.5}]'
            ) from None
    if not isinstance(raw, list):
        raise ConfigError("optimizer.param_groups: must be a list of tables")
    return [_rule(i, entry) for i, entry in enumerate(raw)]


def _rule(i: int, entry: Any) -> Rule:
    where = f"optimizer.param_groups[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: must be a table with match and lr_multiplier/weight_decay")
    unknown = sorted(set(entry) - set(_RULE_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_RULE_KEYS)}"
        )
    match = entry.get("match")
    if not isinstance(match, str) or not match:
        raise ConfigError(
            f"{where}.match: must be a glob over parameter names, e.g. 'layers.*.attention.*'"
        )
    values = {}
    for key in ("lr_multiplier", "weight_decay"):
        value = entry.get(key)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or value < 0 or (key == "lr_multiplier" and value == 0):
            bound = "> 0" if key == "lr_multiplier" else ">= 0"
            raise ConfigError(f"{where}.{key}: {value!r} must be a number {bound}")
        values[key] = float(value)
    if not values:
        raise ConfigError(f"{where}: sets neither lr_multiplier nor weight_decay")
    return Rule(i, match, **values)


def clean_name(name: str) -> str:
    """A parameter's name without the wrappers' parts (as in checkpoints)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def categories(model: nn.Module) -> dict[str, str | None]:
    """``{clean name: category or None}`` of ``model``'s trainable parameters."""
    owners: dict[str, str] = {}
    for mod_name, module in model.named_modules():
        path = clean_name(mod_name + ".")[:-1]
        kind = None
        if isinstance(module, nn.Embedding):
            kind = "embeddings"
        elif isinstance(module, nn.Linear) and path and "." not in path:
            kind = "output"
        if kind is not None:
            for p_name, _ in module.named_parameters(recurse=False):
                owners[clean_name(f"{mod_name}.{p_name}")] = kind
    found: dict[str, str | None] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        name = clean_name(name)
        if name in owners:
            found[name] = owners[name]
        elif name.endswith((".bias", "_bias", ".sinks")):  # experts' stacked biases; sinks
            found[name] = "biases"
        else:
            found[name] = "norms" if p.ndim == 1 else None
    return found


def for_muon(kind: str | None, p: nn.Parameter) -> bool:
    """Whether Muon (``optimizer.name = "Muon"``) updates a parameter of this category: the
    hidden matrices (2-D, or 3-D stacked experts), not embeddings, output, norms or biases."""
    return kind is None and p.ndim in (2, 3)


@dataclass
class Group:
    """The parameters of one model part that share their settings."""

    lr_multiplier: float
    weight_decay: float
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    optimizer: str = ""  # with Muon: "Muon" or "AdamW"

    @property
    def label(self) -> str:
        lr = "" if self.lr_multiplier == 1 else f", lr x{self.lr_multiplier:g}"
        which = f"{self.optimizer}, " if self.optimizer else ""
        return f"{which}weight decay {self.weight_decay:g}{lr}"


def plan_groups(
    model: nn.Module, weight_decay: float, exempt: Iterable[str], rules: list[Rule]
) -> tuple[list[Group], list[int]]:
    """``model``'s trainable parameters in groups, and how many parameters each rule matched
    here (a rule that matches nothing on any rank is the caller's error to raise)."""
    exempt = set(exempt)
    cats = categories(model)
    hits = [0] * len(rules)
    groups: dict[tuple[float, float], Group] = {}
    for name, p in model.named_parameters():
        name = clean_name(name)
        if name not in cats:
            continue
        lr_mult, wd = 1.0, 0.0 if cats[name] in exempt else weight_decay
        setter: dict[str, Rule] = {}
        for rule in rules:
            if not fnmatch.fnmatchcase(name, rule.match):
                continue
            hits[rule.index] += 1
            for key in ("lr_multiplier", "weight_decay"):
                value = getattr(rule, key)
                if value is None:
                    continue
                if key in setter and getattr(setter[key], key) != value:
                    raise ConfigError(
                        f"{rule.describe()}: {key} {value:g} for {name}, which "
                        f"{setter[key].describe()} gives {key} {getattr(setter[key], key):g}; "
                        "make the globs disjoint or the values equal"
                    )
                setter[key] = rule
        if "lr_multiplier" in setter:
            lr_mult = setter["lr_multiplier"].lr_multiplier or 1.0
        if "weight_decay" in setter:
            wd = setter["weight_decay"].weight_decay or 0.0
        group = groups.setdefault((lr_mult, wd), Group(lr_mult, wd))
        group.names.append(name)
        group.params.append(p)
    # the configured settings first: its learning rate is the one logged
    ordered = sorted(
        groups.values(),
        key=lambda g: (g.lr_multiplier != 1, g.weight_decay != weight_decay, -len(g.params)),
    )
    return ordered, hits


def check_and_log(
    plans: list[list[Group]], rules: list[Rule], hits: list[int], group: Any, is_rank0: bool
) -> None:
    """Every rule must match a parameter somewhere (``group``: the ranks holding the other
    pipeline stages, None without pipeline parallelism); rank 0 logs the groups of the whole
    model with their parameter counts. A ConfigError on every rank otherwise."""
    counts: dict[str, list[int]] = {}
    names = [n for plan in plans for g in plan for n in g.names]
    # a block's parameter shows the naming best (layers.0.attention.wqkv.weight)
    example = next(
        (n for n in names if any(p.isdigit() for p in n.split("."))), names[0] if names else ""
    )
    for plan in plans:
        for g in plan:
            c = counts.setdefault(g.label, [0, 0])
            c[0] += len(g.params)
            c[1] += sum(p.numel() for p in g.params)
    mine = {"hits": hits, "counts": counts, "example": example}
    everyone = [mine]
    if group is not None and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
    total_hits = [sum(e["hits"][i] for e in everyone) for i in range(len(rules))]
    for rule, n in zip(rules, total_hits):
        if n == 0:
            raise ConfigError(
                f"{rule.describe()}: matches no parameter of the model; names look like "
                f"'{everyone[0]['example']}' (globs: * ? [seq])"
            )
    merged: dict[str, list[int]] = {}
    for e in everyone:
        for label, (tensors, elements) in e["counts"].items():
            m = merged.setdefault(label, [0, 0])
            m[0], m[1] = m[0] + tensors, m[1] + elements
    if is_rank0:
        parts = [f"{label}: {el:,} parameters in {t} tensors" for label, (t, el) in merged.items()]
        logger.info(f"Optimizer parameter groups: {'; '.join(parts)}")
