"""Apply parallelisms to a Llama Transformer (or a pipeline stage of one) without touching its math.

Order, each step optional: tensor parallel (with sequence parallel on the norms, torchao's float8
styles for float8 linears and, unless ``parallelism.disable_loss_parallel``, a vocab-parallel
loss) -> context parallel (attention over the sequence split across ranks) -> activation
checkpointing -> ``torch.compile`` per transformer block -> FSDP2 ``fully_shard`` per block
and at the root (over ``dp_shard x cp``; HSDP over a 2-D mesh when ``dp_replicate`` is also > 1),
or composable DDP when only ``dp_replicate > 1``. Model code is never edited: only modules are
wrapped or sharded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from torchtitan import float8
from torchtitan.config_manager import JobConfig
from torchtitan.errors import ConfigError
from torchtitan.log import logger
from torchtitan.parallelisms.context_parallel import apply_cp
from torchtitan.parallelisms.parallel_dims import ParallelDims
from torchtitan.utils import waited

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def param_dtype(job_config: JobConfig, device_type: str) -> torch.dtype:
    """Compute dtype for parameters: mixed precision on GPU, float32 on CPU."""
    if device_type == "cpu":
        return torch.float32
    return DTYPES[job_config.training.mixed_precision_param]


def uses_loss_parallel(dims: ParallelDims, job_config: JobConfig) -> bool:
    return dims.tp > 1 and not job_config.parallelism.disable_loss_parallel


def loss_context(dims: ParallelDims, job_config: JobConfig) -> contextlib.AbstractContextManager:
    """Forward-loss-backward runs inside this: the vocab-parallel loss needs ``loss_parallel()``."""
    return loss_parallel() if uses_loss_parallel(dims, job_config) else contextlib.nullcontext()


def build_loss_fn(loss_fn: Callable, dims: ParallelDims, job_config: JobConfig) -> Callable:
    """The loss as training calls it: compiled when ``compile.components`` names it.

    Compiled, the float32 upcast of the logits, the log-softmax and the gather fuse into a few
    kernels instead of materializing float32 logits (batch x seq x vocab) several times. The
    vocab-parallel loss (tensor parallel; DTensor logits under ``loss_parallel()``) stays eager.
    """
    if not job_config.compile.compiles("loss"):
        return loss_fn
    if uses_loss_parallel(dims, job_config):
        logger.info("Loss not compiled: the vocab-parallel loss of tensor parallelism stays eager")
        return loss_fn
    logger.info("Compiled the loss with torch.compile")
    return torch.compile(loss_fn)


def parallelize_llama(
    model: nn.Module,
    mesh: DeviceMesh | None,
    dims: ParallelDims,
    job_config: JobConfig,
    device_type: str,
) -> nn.Module:
    if dims.tp > 1:
        apply_tp(
            model,
            mesh["tp"],
            loss_parallel=uses_loss_parallel(dims, job_config),
            async_tp=job_config.parallelism.enable_async_tensor_parallel,
            compiled_blocks=job_config.compile.compiles("model"),
            float8_tensorwise=float8.tensorwise_tp(job_config),
        )
        logger.info(
            f"Applied tensor + sequence parallel (tp={dims.tp}), loss parallel={uses_loss_parallel(dims, job_config)}"
        )
    if dims.cp > 1:
        apply_cp(model, mesh["cp"])
        logger.info(
            f"Applied context parallel (cp={dims.cp}): all-gather attention, load-balanced chunks"
        )
    ac = job_config.activation_checkpoint
    if ac.mode != "none":
        apply_ac(model, ac.mode, ac.selective_ac_option)
        logger.info(
            f"Applied {ac.mode} activation checkpointing"
            + (f" ({ac.selective_ac_option})" if ac.mode == "selective" else "")
        )
    if job_config.compile.compiles("model"):
        for block in model.layers.values():
            block.compile(fullgraph=True)
        logger.info("Compiled each transformer block with torch.compile")
    if dims.fsdp_enabled:
        reshard = job_config.parallelism.fsdp_reshard_after_forward
        if reshard == "default" and dims.pp > 1:
            # A pipeline stage runs forward once per micro-batch: keep its parameters gathered
            # rather than all-gather them again for every micro-batch.
            reshard = "never"
        apply_fsdp(
            model,
            dims.fsdp_mesh(mesh),
            param_dtype=param_dtype(job_config, device_type),
            reduce_dtype=DTYPES[job_config.training.mixed_precision_reduce],
            reshard_after_forward=reshard,
        )
        logger.info(f"Applied {'HSDP' if dims.dp_replicate_enabled else 'FSDP'} to the model")
    elif dims.dp_replicate_enabled:
        apply_ddp(model, mesh["dp_replicate"])
        logger.info("Applied DDP to the model")
    return model


# ----------------------------------------------------------------------------- tensor parallel


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    *,
    loss_parallel: bool,
    async_tp: bool = False,
    compiled_blocks: bool = False,
    float8_tensorwise: bool = False,
) -> None:
    """Megatron-style TP: column-wise wq/wk/wv/w1/w3, row-wise wo/w2, sequence parallel norms.

    Activations between blocks stay sharded along the sequence (``Shard(1)``); each attention and
    feed-forward input is all-gathered once and its output reduce-scattered back. With
    ``async_tp`` (CUDA and compiled blocks), inductor splits those collectives into pieces that
    overlap with the matmuls through symmetric memory.

    With ``float8_tensorwise`` (float8 converter, tensorwise recipe), the block linears that are
    torchao ``Float8Linear`` get torchao's float8 styles: inputs are cast to float8 (one scale over
    the whole sequence) before the all-gather, which then moves one byte per element, and so are
    the output gradients before their all-gather in backward. Linears left in high precision
    (``float8.filter_fqns``, sizes not divisible by 16) keep the plain styles, and a block input
    is gathered in float8 only if every linear reading it is float8.
    """
    if async_tp:
        from torch._inductor import config as inductor_config
        from torch.distributed._symmetric_memory import enable_symm_mem_for_group

        inductor_config._micro_pipeline_tp = True
        enable_symm_mem_for_group(tp_mesh.get_group().group_name)
    root_plan = _root_plan(model, loss_parallel)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    if compiled_blocks and model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_materialize_async_output)
    styles = _BlockStyles(float8_tensorwise)
    for block in model.layers.values():
        styles.block = block
        parallelize_module(block, tp_mesh, _block_plan(styles))
    if float8_tensorwise:
        logger.info(
            f"Float8 tensor parallel: torchao's float8 styles on {styles.float8_linears} linears, "
            f"{styles.float8_inputs} block inputs all-gathered in float8"
        )


def _root_plan(model: nn.Module, loss_parallel: bool) -> dict[str, Any]:
    """The styles of the modules outside the blocks that this (pipeline) part holds."""
    plan: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    return plan


def _block_plan(styles: Any) -> dict[str, Any]:
    """One transformer block's styles (``styles.block`` is the block)."""
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


class _BlockStyles:
    """The TP style of each linear of ``block``: torchao's float8 style where it is float8."""

    def __init__(self, float8_tensorwise: bool) -> None:
        self.block: nn.Module | None = None  # the block being planned
        self.float8 = float8_tensorwise
        self.float8_linears = self.float8_inputs = 0
        if float8_tensorwise:
            self.f8_colwise, self.f8_rowwise, self.f8_prepare = float8.tp_styles()

    def _is_float8(self, fqn: str) -> bool:
        return self.float8 and float8.is_float8_linear(self.block.get_submodule(fqn))

    def colwise(self, fqn: str, **kwargs) -> ColwiseParallel:
        if not self._is_float8(fqn):
            return ColwiseParallel(**kwargs)
        self.float8_linears += 1
        return self.f8_colwise(**kwargs)

    def rowwise(self, fqn: str, **kwargs) -> RowwiseParallel:
        if not self._is_float8(fqn):
            return RowwiseParallel(**kwargs)
        self.float8_linears += 1
        return self.f8_rowwise(**kwargs)

    def prepare_input(self, fqn: str, readers: tuple[str, ...], **kwargs) -> PrepareModuleInput:
        """Gather ``fqn``'s input in float8 only if every linear reading it casts to float8."""
        if not all(self._is_float8(f"{fqn}.{r}") for r in readers):
            return PrepareModuleInput(**kwargs)
        self.float8_inputs += 1
        # the cast takes its config from the first reader (the converter gives all one config)
        return self.f8_prepare(fwd_config_submodule_fqn=readers[0], **kwargs)


def _materialize_async_output(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    """The embedding's output, waited for before the compiled blocks (:func:`utils.waited`)."""
    return waited(output)


# ----------------------------------------------------------------------------- activation checkpointing

# Ops whose outputs the per-op selective policy keeps: matmuls and attention, the expensive ones.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _op_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str, option: str) -> None:
    """Wrap transformer blocks: all (full), every N-th (selective "N"), or per-op (selective "op")."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    every = 1
    kwargs = {}
    if mode == "selective" and option == "op":
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _op_policy)
    elif mode == "selective":
        if not option.isdigit() or int(option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option: '{option}' must be 'op' or a positive layer interval like '2'"
            )
        every = int(option)
    for i, (name, block) in enumerate(list(model.layers.items())):
        if i % every == 0:
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False, **kwargs)


# ----------------------------------------------------------------------------- data parallel


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    reshard_after_forward: str,
) -> None:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        if reshard_after_forward == "default":
            # The last block's parameters are needed again right away by backward: keep them.
            reshard = i < len(blocks) - 1
        else:
            reshard = reshard_after_forward == "always"
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(
        model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward == "always"
    )


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=dp_mesh, bucket_cap_mb=100)
