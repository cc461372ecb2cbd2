"""Qwen3 (dense): 0.6B to 32B, registered as the ``qwen3`` family."""

from __future__ import annotations

from torchtitan.models.common.registration import register_decoder_family
from torchtitan.models.qwen3.flavors import qwen3_configs
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3ModelArgs
from torchtitan.models.qwen3.parallelize import parallelize_qwen3

__all__ = ["Qwen3Model", "Qwen3ModelArgs", "qwen3_configs"]

register_decoder_family(
    "qwen3", Qwen3Model, qwen3_configs, parallelize_qwen3, Qwen3StateDictAdapter
)
