"""Collective helpers of the checkpoint code: the ranks agree on an error (all raise it or none
does) instead of meeting at a barrier that a failed rank would never reach."""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchtitan.checkpoint.errors import CheckpointError

T = TypeVar("T")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _collective_device() -> torch.device:
    """Where a tensor for the default group's collectives lives (NCCL: this rank's GPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _attempt(fn: Any) -> str | None:
    """Run ``fn``; the one-line description of what it raised (a disk's OSError, storage that
    does not answer), else None: the ranks then agree on it instead of some waiting."""
    try:
        fn()
    except OSError as e:
        return f"Hugging Face export failed: {e}"
    except Exception as e:
        return f"Hugging Face export failed: {type(e).__name__}: {_first_line(e)}"
    return None


def _first_of_all(item: T | None) -> T | None:
    """A collective in place of a barrier: every rank's ``item`` gathered, and the first rank's
    that is not None returned, the same on every rank (None when no rank has one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        items: list[T | None] = [None] * dist.get_world_size()
        dist.all_gather_object(items, item)
        return next((i for i in items if i is not None), None)
    return item


def _agree(error: str | None) -> None:
    """If any rank found ``error``, every rank raises it (the first rank's), so that no rank
    goes on alone to a collective the others never reach."""
    error = _first_of_all(error or None)
    if error:
        raise CheckpointError(error)
