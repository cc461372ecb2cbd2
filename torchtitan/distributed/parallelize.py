"""Apply parallelisms to a decoder (or a pipeline stage of one) without touching its math.

Order, each step optional: expert parallel (each MoE layer's routed experts split over the EP
ranks, tokens dispatched by all-to-all) -> tensor parallel (the family's block plan, sequence parallel on the
norms, torchao's float8 styles for float8 linears and, unless
``parallelism.disable_loss_parallel``, a vocab-parallel loss) -> context parallel (attention over
the sequence split across ranks) -> activation checkpointing -> ``torch.compile`` per block ->
FSDP2 ``fully_shard`` per block and at the root (over ``dp_shard x cp``; HSDP over a 2-D mesh when
``dp_replicate`` is also > 1), or, when only ``dp_replicate > 1``, composable DDP alone and
FSDP2 with one shard rank beside TP or PP (``ParallelDims.replicates_through_fsdp``). Model code is
never edited: only modules are wrapped or sharded.

A family's model spec names its block plan (``ModelSpec.block_plan``); the trainer passes it here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.tensor.parallel import parallelize_module

from torchtitan.config.schema import ActivationCheckpoint, Compile, Parallelism, Training
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.context_parallel import apply_cp
from torchtitan.distributed.data_parallel import DTYPES, apply_ddp, apply_fsdp, param_dtype
from torchtitan.distributed.expert_parallel import ExpertParallel
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.tensor_parallel import apply_tp, uses_loss_parallel
from torchtitan.distributed.utils import blocks
from torchtitan.observability.log import logger


def parallelize_decoder(
    model: nn.Module,
    dims: ParallelDims,
    *,
    block_plan: Callable[[Any], dict[str, Any]],
    device_type: str,
    parallelism: Parallelism,
    ac: ActivationCheckpoint,
    compile: Compile,
    training: Training,
    float8_tensorwise: bool = False,
) -> nn.Module:
    """``block_plan(styles)``: the family's tensor-parallel styles of one block (see
    :func:`~torchtitan.distributed.tensor_parallel.apply_tp`); ``float8_tensorwise``: tensor
    parallel moves float8 activations (torchao's float8 styles, the tensorwise recipe)."""
    if dims.ep > 1:  # before TP: the experts' weights get their EP and TP shards at once
        apply_ep(model, dims)
        whole = ", etp=1: whole experts, each TP rank sends its share of the routed rows"
        logger.info(
            f"Applied expert parallel (ep={dims.ep}{whole if dims.experts_whole_under_tp else ''})"
            ": all-to-all token dispatch"
        )
    if dims.tp > 1:
        apply_tp(
            model,
            dims.sub("tp"),
            block_plan,
            loss_parallel=uses_loss_parallel(dims, parallelism),
            async_tp=parallelism.enable_async_tensor_parallel,
            compiled_blocks=compile.compiles("model"),
            float8_tensorwise=float8_tensorwise,
            experts_whole=dims.experts_whole_under_tp,
        )
        logger.info(
            f"Applied tensor + sequence parallel (tp={dims.tp}), loss parallel={uses_loss_parallel(dims, parallelism)}"
        )
    if dims.cp > 1:
        apply_cp(model, dims.sub("cp"))
        logger.info(
            f"Applied context parallel (cp={dims.cp}): all-gather attention, load-balanced chunks"
        )
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
        logger.info(
            f"Applied {ac.mode} activation checkpointing"
            + (f" ({ac.selective_ac_option})" if ac.mode == "selective" else "")
        )
    if compile.compiles("model"):
        compile_blocks(model, compile, experts_all_to_all=dims.ep > 1)
    _apply_data_parallel(model, dims, parallelism, training, device_type)
    return model


def compile_blocks(model: nn.Module, compile: Compile, *, experts_all_to_all: bool) -> None:
    """torch.compile each transformer block with ``compile.backend``: whole graphs, except
    around the expert-parallel all-to-alls (they need host splits: graph breaks there)."""
    for block in blocks(model):
        fullgraph = not experts_all_to_all or getattr(block, "moe", None) is None
        block.compile(fullgraph=fullgraph, backend=compile.backend)
    logger.info(f"Compiled each transformer block with {compile.described()}")


def _apply_data_parallel(
    model: nn.Module,
    dims: ParallelDims,
    parallelism: Parallelism,
    training: Training,
    device_type: str,
) -> None:
    """FSDP2 (HSDP, or DDP through FSDP with one shard rank) where the layout shards or
    replicates through ``fully_shard``, else plain DDP over ``dp_replicate``."""
    if dims.uses_fully_shard:
        reshard = parallelism.fsdp_reshard_after_forward
        if dims.replicates_through_fsdp:
            reshard = "never"  # one shard rank: the parameters are whole; nothing to free
        elif reshard == "default" and dims.pp > 1:
            # A pipeline stage runs forward once per micro-batch: keep its parameters gathered
            # rather than all-gather them again for every micro-batch.
            reshard = "never"
        apply_fsdp(
            model,
            dims.fsdp_mesh,
            param_dtype=param_dtype(training, device_type),
            reduce_dtype=DTYPES[training.mixed_precision_reduce],
            reshard_after_forward=reshard,
            experts_mesh=dims.expert_fsdp_mesh if dims.ep > 1 else None,
            experts_divide_factor=dims.dp_replicate * dims.dp_shard * dims.cp,
            root_used_after_forward=training.loss_chunks > 1,
        )
        if dims.replicates_through_fsdp:
            logger.info(
                f"Applied DDP (dp_replicate={dims.dp_replicate}) through FSDP2: HSDP with one "
                "shard rank, whole parameters on every rank"
            )
        else:
            logger.info(f"Applied {'HSDP' if dims.dp_replicate_enabled else 'FSDP'} to the model")
    elif dims.dp_replicate_enabled:
        apply_ddp(model, dims.sub("dp_replicate"))
        logger.info("Applied DDP to the model")


def apply_ep(model: nn.Module, dims: ParallelDims) -> None:
    """Each MoE layer's routed experts over the EP ranks, and their hidden dim over the TP ranks
    (the same shards tensor parallel gives them without EP) unless they stay whole (``etp`` 1)."""
    tp_split = dims.tp > 1 and not dims.experts_whole_under_tp
    mesh = dims.expert_mesh[("ep", "tp")] if tp_split else dims.expert_mesh["ep"]
    for block in blocks(model):
        if getattr(block, "moe", None) is not None:
            parallelize_module(block.moe.experts, mesh, ExpertParallel())
