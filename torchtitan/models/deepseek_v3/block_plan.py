"""DeepSeek-V3's tensor-parallel plan of one block: multi-head latent attention split by head,
the feed-forward (dense or DeepSeekMoE) as the shared plan has it.

The heads' projections are split column-wise (``wq`` or ``wq_b``, and ``wkv_b``, which expands
the latent into each head's keys and values) and ``wo`` row-wise, as upstream torchtitan and
Megatron-Core split MLA. The low-rank down-projections (``wq_a``, ``wkv_a``) and their norms
are not split: they are small (``dim x (q_lora_rank + kv_lora_rank + qk_rope_head_dim)``) and
every head reads their whole output, so each rank computes them whole
(:class:`~torchtitan.distributed.tensor_parallel.ReplicatedCompute`). Their gradients are the
sums of every rank's heads' shares: the column-wise readers sum theirs; the rotary key channels
of ``wkv_a``'s output, read directly by each rank's heads, are summed where they leave it.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

from torchtitan.distributed.tensor_parallel import (
    BlockStyles,
    ReplicatedCompute,
    feed_forward_plan,
    moe_plan,
)


def block_plan(styles: BlockStyles) -> dict[str, Any]:
    attention = styles.block.attention
    plan: dict[str, Any] = {
        "attention_norm": SequenceParallel(),
        # the whole sequence, as a local tensor: every projection reads it whole
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None),  # x, rope_cache, mask (None: causal)
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.wkv_a": ReplicatedCompute(sum_grad_from=attention.kv_lora_rank),
        "attention.kv_norm": ReplicatedCompute(),
        "attention.wkv_b": styles.colwise("attention.wkv_b"),
        "attention.wo": styles.rowwise("attention.wo", output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if attention.q_lora_rank == 0:
        plan["attention.wq"] = styles.colwise("attention.wq")
    else:
        plan |= {
            "attention.wq_a": ReplicatedCompute(),
            "attention.q_norm": ReplicatedCompute(),
            "attention.wq_b": styles.colwise("attention.wq_b"),
        }
    moe = getattr(styles.block, "moe", None) is not None
    return plan | (moe_plan(styles) if moe else feed_forward_plan(styles))
