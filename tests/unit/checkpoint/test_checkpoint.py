"""Checkpoint checks that need no training run: the metadata unpickler refuses code, the folder
scan orders steps and reads markers, and a seed checkpoint needs one process. Resuming through
./run_llama_train.sh is in tests/e2e/test_checkpoint.py; the checkpoint package's internals in
tests/unit/checkpoint/test_checkpoint_internals.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchtitan.checkpoint import scan


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_checkpoint_metadata_cannot_run_code(tmp_path):
    """DCP's metadata is a pickle: only DCP's own metadata classes may be built from it."""
    import pickle

    from torchtitan.checkpoint import CheckpointError
    from torchtitan.checkpoint.safe_read import _checkpoint_keys

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="is not allowed in checkpoint metadata"):
        _checkpoint_keys(str(tmp_path))
    assert not (Path.cwd() / "pwned").exists()


def test_scan_orders_steps_and_reads_markers(tmp_path):
    for step, marker in ((10, '{"step": 10, "model_only": true}'), (2, "{"), (5, None)):
        (tmp_path / f"step-{step}").mkdir()
        if marker is not None:
            (tmp_path / f"step-{step}" / "COMPLETE").write_text(marker)
    (tmp_path / "step-x").mkdir()
    assert [(c.step, c.complete, c.model_only) for c in scan(str(tmp_path))] == [
        (2, False, False),  # an unreadable marker is no marker
        (5, False, False),
        (10, True, True),
    ]


def test_seed_checkpoint_needs_one_process():
    from torchtitan.config.parse import parse_args
    from torchtitan.errors import ConfigError
    from torchtitan.train.plan import plan_job

    cfg = parse_args(["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"])
    with pytest.raises(ConfigError, match="create_seed_checkpoint: runs on one process"):
        plan_job(cfg, world_size=2)
    with pytest.raises(ConfigError, match="needs checkpoint.enable = true"):
        parse_args(["--checkpoint.create_seed_checkpoint"])


class _EvilGetattr:
    def __reduce__(self):
        return (getattr, (Path, "cwd"))  # any attribute of an allowed class: not allowed


def test_metadata_getattr_only_gives_enum_members(tmp_path):
    import pickle

    from torchtitan.checkpoint import CheckpointError
    from torchtitan.checkpoint.safe_read import _checkpoint_keys

    (tmp_path / ".metadata").write_bytes(pickle.dumps(_EvilGetattr()))
    with pytest.raises(CheckpointError, match="is not allowed in checkpoint metadata"):
        _checkpoint_keys(str(tmp_path))
