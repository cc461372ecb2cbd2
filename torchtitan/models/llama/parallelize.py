"""Llama's parallelisms: its blocks are the shared ``TransformerBlock``, so its tensor-parallel
plan is the shared decoder block plan; everything else is generic."""

from __future__ import annotations

from functools import partial

from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import decoder_block_plan

parallelize_llama = partial(parallelize_decoder, block_plan=decoder_block_plan)
