"""Activation checkpointing of a decoder's blocks: all, every N-th, or per op (selective)."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from torchtitan.distributed.utils import block_slots
from torchtitan.errors import ConfigError

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


def _ignore_profiler_ranges() -> None:
    """Keep the profiler's ``record_function`` ranges out of per-op checkpointing's replay.
    Selective checkpointing numbers every op a block runs in its forward and expects the same
    ops, in the same number, when it recomputes the block; FSDP opens ranges (pre_forward,
    all_gather, ...) as its hooks run, and a block holding a module FSDP shards apart (the
    routed experts under expert parallel) opens a different number of them in the forward and
    in the recomputation, so the replay fails ("profiler._record_function_enter_new.default
    invocation index 3 encountered during backward but not found in storage", torch 2.13;
    pytorch/torchtitan#3427). The ranges are annotations, not computation: torch's own list of
    ops the replay skips (``SAC_IGNORED_OPS``, as pytorch/pytorch#196862 proposes) takes them."""
    from torch.utils import checkpoint

    ops = torch.ops.profiler
    names = ("_record_function_enter", "_record_function_enter_new", "_record_function_exit")
    for name in names:
        packet = getattr(ops, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            checkpoint.SAC_IGNORED_OPS.add(getattr(packet, overload))


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
        _ignore_profiler_ranges()
        kwargs["context_fn"] = partial(create_selective_checkpoint_contexts, _op_policy)
    elif mode == "selective":
        if not option.isdigit() or int(option) < 1:
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option: '{option}' must be 'op' or a positive layer interval like '2'"
            )
        every = int(option)
    for i, (container, name) in enumerate(block_slots(model)):
        if i % every == 0:
            block = getattr(container, name)
            setattr(container, name, checkpoint_wrapper(block, preserve_rng_state=False, **kwargs))
