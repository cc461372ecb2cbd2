"""gpt-oss: 20b and 120b, registered as the ``gpt_oss`` family."""

from __future__ import annotations

from torchtitan.models.gpt_oss.flavors import gpt_oss_configs
from torchtitan.models.gpt_oss.hf_adapter import GptOssStateDictAdapter
from torchtitan.models.gpt_oss.model import GptOssModel, GptOssModelArgs
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["GptOssModel", "GptOssModelArgs", "gpt_oss_configs"]

register_model_spec(
    ModelSpec(
        "gpt_oss",
        GptOssModel,
        gpt_oss_configs,
        GptOssStateDictAdapter,
    )
)
