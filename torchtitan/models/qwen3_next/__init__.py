"""Qwen3-Next: 80B-A3B, registered as the ``qwen3_next`` family."""

from __future__ import annotations

from torchtitan.models.qwen3_next.block_plan import block_plan
from torchtitan.models.qwen3_next.flavors import qwen3_next_configs
from torchtitan.models.qwen3_next.hf_adapter import Qwen3NextStateDictAdapter
from torchtitan.models.qwen3_next.model import Qwen3NextModel, Qwen3NextModelArgs
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["Qwen3NextModel", "Qwen3NextModelArgs", "qwen3_next_configs"]

register_model_spec(
    ModelSpec(
        "qwen3_next",
        Qwen3NextModel,
        qwen3_next_configs,
        Qwen3NextStateDictAdapter,
        block_plan=block_plan,
    )
)
