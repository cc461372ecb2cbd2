"""Data parallelism: FSDP2 ``fully_shard`` per block and at the root (HSDP over a 2-D mesh), or
composable DDP; and the parameter dtype of mixed precision."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from torchtitan.config.schema import Training
from torchtitan.distributed.utils import blocks

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def param_dtype(training: Training, device_type: str) -> torch.dtype:
    """Compute dtype for parameters: mixed precision on GPU, float32 on CPU."""
    if device_type == "cpu":
        return torch.float32
    return DTYPES[training.mixed_precision_param]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
    experts_mesh: DeviceMesh | None = None,
    experts_divide_factor: int = 1,
    root_used_after_forward: bool = False,
) -> None:
    """``fully_shard`` per block and at the root over ``dp_mesh``. ``root_used_after_forward``:
    the loss calls the output projection itself after the model's forward (``loss_chunks``), so
    the root's parameters stay gathered until backward even under ``"always"`` (resharded, the
    projection would get sharded weights outside any FSDP hook). Under expert parallelism
    (``experts_mesh``: the experts' FSDP mesh) each MoE layer's routed experts are sharded by
    their own ``fully_shard`` over that mesh, their summed gradients divided by
    ``experts_divide_factor`` (every rank that averages gradients: see expert_parallel.py)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    all_blocks = blocks(model)
    for i, block in enumerate(all_blocks):
        if reshard_after_forward == "default":
            # The last block's parameters are needed again right away by backward: keep them.
            reshard = i < len(all_blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        moe = getattr(block, "moe", None)
        if experts_mesh is not None and moe is not None:
            experts = fully_shard(
                moe.experts, mesh=experts_mesh, mp_policy=mp, reshard_after_forward=reshard
            )
            experts.set_gradient_divide_factor(experts_divide_factor)
            if experts_mesh.size(-1) > 1:
                # sum, then divide: gloo has no pre-multiplied sum (NCCL's way to divide). Not
                # with one shard rank: torch 2.13's FSDP then divides the copied gradient by the
                # factor and again after the reduction (expert gradients 1/ep of their value)
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    root_reshard = reshard_after_forward == "always" and not root_used_after_forward
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=root_reshard)


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
