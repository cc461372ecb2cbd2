"""Qwen3-Next's tensor-parallel plan of one block; the rest of the parallelisms are generic."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel

from torchtitan.distributed.tensor_parallel import (
    BlockStyles,
    HeadShardedNorm,
    InOrder,
    ShardParameters,
    decoder_block_plan,
    feed_forward_plan,
    moe_plan,
)


def block_plan(styles: BlockStyles) -> dict[str, Any]:
    """A gated softmax-attention block: the shared decoder plan (``wqkv`` column-wise in whole
    kv groups, each query head with its gate) plus the QK norms sharded by head, as Qwen3's.

    A linear-attention block (Gated DeltaNet), Megatron-style by key-head group:
    ``in_proj_qkvz`` and ``in_proj_ba`` column-wise (their rows are grouped by key head, so a
    rank gets whole groups: its key heads and their value heads), the convolution's channels and
    the per-value-head ``A_log`` / ``dt_bias`` split the same way (``Shard(0)``: the layer keeps
    them grouped), the gated output norm sharded by head, ``out_proj`` row-wise back to the
    sequence-sharded ``Shard(1)``. The delta rule runs on each rank's heads alone."""
    block = styles.block
    if not hasattr(block.attention, "rule"):
        head_sharded_norm = SequenceParallel(sequence_dim=2, use_local_output=True)
        return {
            **decoder_block_plan(styles),
            "attention.q_norm": head_sharded_norm,
            "attention.k_norm": head_sharded_norm,
        }
    ffn = moe_plan(styles) if block.moe is not None else feed_forward_plan(styles)
    prepare = styles.prepare_input(
        "attention",
        ("in_proj_qkvz", "in_proj_ba"),
        input_layouts=(Shard(1), None, None),  # x, rope_cache (unused), mask
        desired_input_layouts=(Replicate(), None, None),
    )
    by_head = ShardParameters({"conv_weight": 0, "A_log": 0, "dt_bias": 0})
    return {
        "attention_norm": SequenceParallel(),
        "attention": InOrder(prepare, by_head),
        "attention.in_proj_qkvz": styles.colwise("attention.in_proj_qkvz"),
        "attention.in_proj_ba": styles.colwise("attention.in_proj_ba"),
        "attention.norm": HeadShardedNorm(head_dim=2),
        "attention.out_proj": styles.rowwise("attention.out_proj", output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        **ffn,
    }
