"""DeepSeek-V3 / Kimi K2 / Moonlight (multi-head latent attention, DeepSeekMoE), registered as the
``deepseek_v3`` family (every parallelism; multi-token prediction refuses tensor and context
parallel, in one line)."""

from __future__ import annotations

from torchtitan.models.deepseek_v3.block_plan import block_plan
from torchtitan.models.deepseek_v3.flavors import deepseek_v3_configs
from torchtitan.models.deepseek_v3.hf_adapter import DeepSeekV3StateDictAdapter
from torchtitan.models.deepseek_v3.model import DeepSeekV3Model, DeepSeekV3ModelArgs
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["DeepSeekV3Model", "DeepSeekV3ModelArgs", "deepseek_v3_configs"]

register_model_spec(
    ModelSpec(
        "deepseek_v3",
        DeepSeekV3Model,
        deepseek_v3_configs,
        DeepSeekV3StateDictAdapter,
        block_plan=block_plan,
    )
)
