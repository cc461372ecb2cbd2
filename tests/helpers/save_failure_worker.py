"""Run by tests/e2e/test_checkpoint_disk.py under torchrun (2 CPU processes, gloo): a save whose
failure only rank 0 sees (its ``COMPLETE`` marker cannot be written), synchronously or in the
background, where the ranks find out at different steps. Every rank must reach the same decision
at the same call. Usage::

    save_failure_worker.py FOLDER sync|async stop|continue

Each rank prints ``RESULT <rank> <call> <outcome>`` per call and ``LOG <rank> <line>`` per
error line it logged."""

from __future__ import annotations

import errno
import logging
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan.checkpoint import CheckpointManager, TrainState
from torchtitan.checkpoint import manager as manager_module
from torchtitan.config.schema import JobConfig
from torchtitan.errors import CheckpointSaveFailed


class _Stateful:
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": torch.zeros(4)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        pass


class _Lines(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _out(f"LOG {dist.get_rank()} {record.getMessage()}")


def _out(line: str) -> None:
    """One line in one write: the two ranks share the pipe, and lines must not interleave."""
    os.write(1, f"{line}\n".encode())


def _no_space(*args, **kwargs) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _call(rank: int, name: str, fn) -> None:
    try:
        outcome = f"returned {fn()}"
    except CheckpointSaveFailed as e:
        outcome = f"raised {e}"
    _out(f"RESULT {rank} {name} {outcome}")


def main(folder: str, mode: str, on_save_error: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    logging.getLogger("torchtitan").addHandler(_Lines(level=logging.ERROR))
    cfg = JobConfig()
    cfg.job.dump_folder = folder
    cfg.training.steps = 100
    cfg.checkpoint.enable = True
    cfg.checkpoint.keep_latest_k = 1
    cfg.checkpoint.on_save_error = on_save_error
    cfg.checkpoint.async_mode = "async" if mode == "async" else "disabled"
    torch.manual_seed(0)
    manager = CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        total_steps=cfg.training.steps,
        model_parts=[nn.Linear(8, 8)],
        optimizers=_Stateful(),
        lr_schedulers=_Stateful(),
        dataloader=_Stateful(),
        train_state=TrainState(),
        rank=rank,
        world_size=dist.get_world_size(),
    )
    manager.save(5, model_only=False)
    manager.wait()
    real_marker = manager_module.write_marker
    if rank == 0:
        manager_module.write_marker = _no_space  # only rank 0 writes the marker: only it fails
    if mode == "sync":
        _call(rank, "save-10", lambda: manager.save(10, model_only=False))
    else:
        manager.save(10, model_only=False)  # in the background
        if rank == 0:  # finds out (poll, as each step does); rank 1 has not looked yet
            while manager._pending is not None:
                manager.poll()
    manager_module.write_marker = real_marker
    _call(rank, "save-15", lambda: manager.save(15, model_only=False))
    _call(rank, "close", manager.close)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
