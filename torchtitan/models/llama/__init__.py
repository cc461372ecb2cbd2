"""Llama 2 and Llama 3 (3.1, 3.2): one implementation, two registered families."""

from __future__ import annotations

from torchtitan.models.common.registration import register_decoder_family
from torchtitan.models.llama.flavors import llama2_configs, llama3_configs
from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.models.llama.parallelize import parallelize_llama

__all__ = ["ModelArgs", "Transformer"]

for _name, _flavors in (("llama2", llama2_configs), ("llama3", llama3_configs)):
    register_decoder_family(_name, Transformer, _flavors, parallelize_llama, LlamaStateDictAdapter)
