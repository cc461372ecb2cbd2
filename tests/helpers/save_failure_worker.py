"""A case of tests/e2e/test_checkpoint_disk.py, run on both ranks of a warm pool
(tests/helpers/pool.py, gloo): a save whose failure only rank 0 sees (its ``COMPLETE`` marker
cannot be written), synchronously or in the background, where the ranks find out at different
steps. Every rank must reach the same decision at the same call.

``save_failure_worker:run(folder, "sync"|"async", "stop"|"continue")`` returns the rank's lines:
``RESULT <rank> <call> <outcome>`` per call and ``LOG <rank> <line>`` per error line it logged."""

from __future__ import annotations

import errno
import logging

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
    def __init__(self, lines: list[str]) -> None:
        super().__init__(level=logging.ERROR)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"LOG {dist.get_rank()} {record.getMessage()}")


def _no_space(*args, **kwargs) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _call(lines: list[str], rank: int, name: str, fn) -> None:
    try:
        outcome = f"returned {fn()}"
    except CheckpointSaveFailed as e:
        outcome = f"raised {e}"
    lines.append(f"RESULT {rank} {name} {outcome}")


def run(folder: str, mode: str, on_save_error: str) -> list[str]:
    lines: list[str] = []
    handler = _Lines(lines)
    logging.getLogger("torchtitan").addHandler(handler)
    real_marker = manager_module.write_marker
    try:
        _saves(lines, folder, mode, on_save_error)
    finally:
        manager_module.write_marker = real_marker
        logging.getLogger("torchtitan").removeHandler(handler)
    return lines


def _saves(lines: list[str], folder: str, mode: str, on_save_error: str) -> None:
    rank = dist.get_rank()
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
        _call(lines, rank, "save-10", lambda: manager.save(10, model_only=False))
    else:
        manager.save(10, model_only=False)  # in the background
        if rank == 0:  # finds out (poll, as each step does); rank 1 has not looked yet
            while manager._pending is not None:
                manager.poll()
    manager_module.write_marker = real_marker
    _call(lines, rank, "save-15", lambda: manager.save(15, model_only=False))
    _call(lines, rank, "close", manager.close)
    dist.barrier()
