"""Qwen3 (dense): 0.6B to 32B, registered as the ``qwen3`` family."""

from __future__ import annotations

from torchtitan.models.qwen3.block_plan import block_plan
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3ModelArgs
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "qwen3_configs"]

register_model_spec(
    ModelSpec("qwen3", Qwen3Model, qwen3_configs, Qwen3StateDictAdapter, block_plan=block_plan)
)
