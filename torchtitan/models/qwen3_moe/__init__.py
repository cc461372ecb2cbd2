"""Qwen3-MoE: 30B-A3B and 235B-A22B, registered as the ``qwen3_moe`` family."""

from __future__ import annotations

from torchtitan.models.qwen3.block_plan import block_plan
from torchtitan.models.qwen3_moe.flavors import qwen3_moe_configs
from torchtitan.models.qwen3_moe.hf_adapter import Qwen3MoeStateDictAdapter
from torchtitan.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["Qwen3MoeModel", "Qwen3MoeModelArgs", "qwen3_moe_configs"]

register_model_spec(
    ModelSpec(
        "qwen3_moe",
        Qwen3MoeModel,
        qwen3_moe_configs,
        Qwen3MoeStateDictAdapter,
        block_plan=block_plan,
    )
)
