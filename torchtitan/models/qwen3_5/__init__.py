"""Qwen3.5's language models (dense 0.8B to 27B, MoE 35B-A3B to 397B-A17B), registered as the
``qwen3_5`` family: Qwen3-Next's model (``models/qwen3_next``) with these sizes and the Qwen3.5
checkpoint layout."""

from __future__ import annotations

from torchtitan.models.qwen3_5.flavors import qwen3_5_configs
from torchtitan.models.qwen3_5.hf_adapter import Qwen3_5StateDictAdapter
from torchtitan.models.qwen3_next.block_plan import block_plan
from torchtitan.models.qwen3_next.model import Qwen3NextModel
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["qwen3_5_configs"]

register_model_spec(
    ModelSpec(
        "qwen3_5",
        Qwen3NextModel,
        qwen3_5_configs,
        Qwen3_5StateDictAdapter,
        block_plan=block_plan,
    )
)
