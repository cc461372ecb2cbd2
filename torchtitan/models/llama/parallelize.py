"""Llama's tensor-parallel plan of one block; the rest of the parallelisms are generic."""

from __future__ import annotations

from functools import partial
from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from torchtitan.distributed.parallelize import parallelize_decoder
from torchtitan.distributed.tensor_parallel import BlockStyles


def block_plan(styles: BlockStyles) -> dict[str, Any]:
    """Megatron-style: column-wise wq/wk/wv/w1/w3, row-wise wo/w2 (their outputs reduce-scattered
    back to the sequence-sharded ``Shard(1)`` activations), sequence-parallel norms. ``styles``
    picks torchao's float8 style for float8 linears (``styles.block`` is the block)."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": styles.prepare_input(
            "attention",
            ("wq", "wk", "wv"),
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
        ),
        "attention.wq": styles.colwise("attention.wq"),
        "attention.wk": styles.colwise("attention.wk"),
        "attention.wv": styles.colwise("attention.wv"),
        "attention.wo": styles.rowwise("attention.wo", output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": styles.prepare_input(
            "feed_forward",
            ("w1", "w3"),
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
        ),
        "feed_forward.w1": styles.colwise("feed_forward.w1"),
        "feed_forward.w2": styles.rowwise("feed_forward.w2", output_layouts=Shard(1)),
        "feed_forward.w3": styles.colwise("feed_forward.w3"),
    }


parallelize_llama = partial(parallelize_decoder, block_plan=block_plan)
