"""Llama 4 (text): Scout 17Bx16E and Maverick 17Bx128E, registered as the ``llama4`` family."""

from __future__ import annotations

from torchtitan.models.llama4.flavors import llama4_configs
from torchtitan.models.llama4.hf_adapter import Llama4StateDictAdapter
from torchtitan.models.llama4.model import Llama4Model, Llama4ModelArgs
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["Llama4Model", "Llama4ModelArgs", "llama4_configs"]

register_model_spec(ModelSpec("llama4", Llama4Model, llama4_configs, Llama4StateDictAdapter))
