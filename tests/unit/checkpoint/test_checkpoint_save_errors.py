"""A checkpoint save that fails, in this process (single-process DCP, no process group): the
previous complete checkpoint stays, the failed folder goes, and ``checkpoint.on_save_error``
decides between one error and one logged line. The write errors are real: a file-size limit
(``RLIMIT_FSIZE``; Python ignores SIGXFSZ, so a write past it fails with EFBIG) makes DCP's
data file fail mid-write. The marker's failure is made by replacing ``write_marker``. Two ranks
agreeing, and a real full disk, are in tests/e2e/test_checkpoint_disk.py."""

from __future__ import annotations

import errno
import logging
import resource
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from log_capture import logged
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint import MARKER, CheckpointManager, TrainState, scan
from torchtitan.checkpoint import manager as manager_module
from torchtitan.checkpoint.save_failure import SaveFailure, continue_line, describe, stop_line
from torchtitan.config.schema import JobConfig
from torchtitan.errors import CheckpointSaveFailed

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def errors():
    """The ERROR lines the ``torchtitan`` logger emits during the test."""
    with logged(logging.ERROR) as lines:
        yield lines


@contextmanager
def files_at_most(size: int):
    """Writes past ``size`` bytes into any file fail (EFBIG) in this process, for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


class _Stateful:
    def __init__(self) -> None:
        self.value = torch.zeros(4)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"value": self.value.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.value = state["value"].clone()


def _manager(tmp_path: Path, **checkpoint) -> CheckpointManager:
    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.checkpoint.enable = True
    cfg.training.steps = 100
    for k, v in checkpoint.items():
        setattr(cfg.checkpoint, k, v)
    return CheckpointManager(
        cfg.checkpoint,
        dump_folder=cfg.job.dump_folder,
        total_steps=cfg.training.steps,
        model_parts=[nn.Linear(16, 16)],  # a data file of about 17 kB: over the limit below
        optimizers=_Stateful(),
        lr_schedulers=_Stateful(),
        dataloader=_Stateful(),
        train_state=TrainState(),
        rank=0,
        world_size=1,
    )


LIMIT = 8000  # the metadata (2 kB) and the marker fit, the data file does not


def _steps(tmp_path: Path) -> list[tuple[int, bool]]:
    return [(c.step, c.complete) for c in scan(str(tmp_path / "checkpoint"))]


# ----------------------------------------------------------------------------- the lines


def _wrapped(e: BaseException) -> tuple[BaseException, traceback.StackSummary]:
    return (e, traceback.StackSummary.from_list([]))


def test_describe_names_the_disk_error_and_the_ranks():
    full = OSError(errno.ENOSPC, "No space left on device")
    assert describe(full) == "[Errno 28] No space left on device"
    alone = CheckpointException("write", {0: _wrapped(full)})
    assert describe(alone) == "[Errno 28] No space left on device"  # a single process
    one = CheckpointException("write", {3: _wrapped(full)})
    assert describe(one, 8) == "[Errno 28] No space left on device (rank 3)"
    two = CheckpointException("write", {1: _wrapped(ValueError("x")), 0: _wrapped(full)})
    assert describe(two, 2) == "[Errno 28] No space left on device (ranks 0, 1)"
    many = CheckpointException("write", {r: _wrapped(full) for r in range(7)})
    assert describe(many, 8) == "[Errno 28] No space left on device (ranks 0, 1, 2, 3 and 3 more)"
    assert describe(RuntimeError("bad\nsecond line")) == "RuntimeError: bad"


def test_the_stop_and_continue_lines():
    failure = SaveFailure("/c/step-20", 20, "[Errno 28] No space left on device")
    assert stop_line(failure, "/c/step-10") == (
        "checkpoint save to /c/step-20 failed: [Errno 28] No space left on device; the newest "
        "complete checkpoint, /c/step-10, is kept; free space (or fix what the error names) and "
        'start again to resume, or set checkpoint.on_save_error = "continue" to train on when a '
        "save fails"
    )
    assert continue_line(failure, None) == (
        "checkpoint save to /c/step-20 failed: [Errno 28] No space left on device; training goes "
        'on and the next save tries again (checkpoint.on_save_error = "continue"); there is no '
        "complete checkpoint yet"
    )
    assert "; the run ends without it (" in continue_line(failure, None, last=True)


# ----------------------------------------------------------------------------- a real write error


def test_a_failed_save_stops_and_keeps_the_previous_checkpoint(tmp_path):
    manager = _manager(tmp_path, keep_latest_k=1)
    assert manager.save(5, model_only=False) is not None
    with files_at_most(LIMIT), pytest.raises(CheckpointSaveFailed) as e:
        manager.save(10, model_only=False)
    folder = tmp_path / "checkpoint"
    assert str(e.value) == stop_line(
        SaveFailure(str(folder / "step-10"), 10, "[Errno 27] File too large"),
        str(folder / "step-5"),
    )
    assert e.value.exit_code == 5
    # keep_latest_k = 1 purged nothing: only a marked save may push an older one out
    assert _steps(tmp_path) == [(5, True)]


def test_with_continue_a_failed_save_is_logged_and_the_next_one_succeeds(tmp_path, errors):
    manager = _manager(tmp_path, keep_latest_k=1, on_save_error="continue")
    manager.save(5, model_only=False)
    with files_at_most(LIMIT):
        assert manager.save(10, model_only=False) is None
    folder = tmp_path / "checkpoint"
    assert errors == [
        continue_line(
            SaveFailure(str(folder / "step-10"), 10, "[Errno 27] File too large"),
            str(folder / "step-5"),
        )
    ]
    assert _steps(tmp_path) == [(5, True)]
    assert manager.save(15, model_only=False) == str(folder / "step-15")
    assert _steps(tmp_path) == [(15, True)]  # retention, once a new one is marked


def test_a_failed_marker_fails_the_save(tmp_path, monkeypatch):
    manager = _manager(tmp_path, keep_latest_k=1)
    manager.save(5, model_only=False)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(manager_module, "write_marker", no_space)
    with pytest.raises(CheckpointSaveFailed, match=r"step-10 failed: \[Errno 28\] No space left"):
        manager.save(10, model_only=False)
    assert _steps(tmp_path) == [(5, True)]


def test_a_background_save_that_fails_stops_the_run_at_the_next_save(tmp_path, errors):
    manager = _manager(tmp_path, async_mode="async")
    manager.save(5, model_only=False)
    assert manager.wait() is True
    with files_at_most(LIMIT):
        manager.save(10, model_only=False)
        while manager._pending is not None:
            manager.poll()  # what every step does: finds the failure, does not act on it
    folder = tmp_path / "checkpoint"
    assert errors == [
        f"checkpoint save to {folder / 'step-10'} failed: [Errno 27] File too large; the run "
        "stops at its next save or its end, where every rank waits for it "
        '(checkpoint.on_save_error = "stop")'
    ]
    assert _steps(tmp_path) == [(5, True)]
    with pytest.raises(CheckpointSaveFailed, match="step-10 failed: .Errno 27. File too large"):
        manager.save(15, model_only=False)
    assert _steps(tmp_path) == [(5, True)]  # stopped before writing anything else


def test_the_end_of_training_acts_on_a_failed_background_save(tmp_path):
    manager = _manager(tmp_path, async_mode="async")
    with files_at_most(LIMIT):
        manager.save(100, model_only=False)
        with pytest.raises(CheckpointSaveFailed, match="there is no complete checkpoint yet"):
            manager.close()
    assert _steps(tmp_path) == []


def test_a_save_before_exit_writes_anew_after_a_failed_save_of_that_step(tmp_path, errors):
    manager = _manager(tmp_path, async_mode="async", on_save_error="continue")
    with files_at_most(LIMIT):
        manager.save(10, model_only=False)
        assert manager.save_before_exit(10) is None  # it waited for that save, which failed
    assert len(errors) == 1 and "; training goes on and the next save tries again" in errors[0]
    path = manager.save_before_exit(10)  # nothing of step 10 on disk: written now, synchronously
    assert path == str(tmp_path / "checkpoint" / "step-10")
    assert (Path(path) / MARKER).is_file()
    assert manager.save_before_exit(10) == path  # already written: not written again
