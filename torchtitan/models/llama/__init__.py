"""Llama 2 and Llama 3 (3.1, 3.2): one implementation, two registered families."""

from __future__ import annotations

from torchtitan.models.llama.flavors import llama2_configs, llama3_configs
from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.spec import ModelSpec, register_model_spec

__all__ = ["ModelArgs", "Transformer"]

for _name, _flavors in (("llama2", llama2_configs), ("llama3", llama3_configs)):
    register_model_spec(ModelSpec(_name, Transformer, _flavors, LlamaStateDictAdapter))
