"""Qwen3-MoE: 30B-A3B and 235B-A22B, registered as the ``qwen3_moe`` family."""

from __future__ import annotations

from torchtitan.models.common.registration import register_decoder_family
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3_moe.flavors import qwen3_moe_configs
from torchtitan.models.qwen3_moe.hf_adapter import Qwen3MoeStateDictAdapter
from torchtitan.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs

__all__ = ["Qwen3MoeModel", "Qwen3MoeModelArgs", "qwen3_moe_configs"]

register_decoder_family(
    "qwen3_moe", Qwen3MoeModel, qwen3_moe_configs, parallelize_qwen3, Qwen3MoeStateDictAdapter
)
