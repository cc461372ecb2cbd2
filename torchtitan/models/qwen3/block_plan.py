"""Qwen3's tensor-parallel plan of one block (Qwen3-MoE's too); the rest of the parallelisms are
generic."""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor.parallel import SequenceParallel

from torchtitan.distributed.tensor_parallel import BlockStyles, decoder_block_plan


def block_plan(styles: BlockStyles) -> dict[str, Any]:
    """The shared decoder block plan (Megatron-style, as for Llama) plus the QK norms.

    QK norms: after the column-wise ``wqkv`` each TP rank holds whole groups of heads (a plain
    local ``[B, T, kv_heads / tp, heads_per_group, head_dim]`` tensor inside the attention), and each norm normalizes every
    head by itself with one ``[head_dim]`` scale. They are therefore "sequence parallel" over the
    head dimension: the weight becomes a replicated DTensor on the TP mesh (so FSDP x TP sees a
    DTensor on that mesh like every other parameter), the local heads are wrapped as
    ``Shard(2)`` of the full tensor, and the output goes back to a local tensor for the rotary
    embedding and attention. The weight gradient of a rank covers its own heads only; DTensor
    marks it ``Partial`` and all-reduces it over the TP ranks (what transformers' plan calls
    ``replicated_with_grad_allreduce``). ``styles`` picks torchao's float8 style for float8
    linears (``styles.block`` is the block).
    """
    head_sharded_norm = SequenceParallel(sequence_dim=2, use_local_output=True)
    return {
        **decoder_block_plan(styles),
        "attention.q_norm": head_sharded_norm,
        "attention.k_norm": head_sharded_norm,
    }
