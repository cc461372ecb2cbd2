"""The checkpoint folder: ``step-N`` folders, the ``COMPLETE`` marker, and the pure decisions the
manager takes over them (what to resume from, what to set aside, what retention removes).

Layout: ``{job.dump_folder}/{checkpoint.folder}/step-{N}/`` holds DCP's ``.metadata`` and one
``*.distcp`` file per writing rank, then ``COMPLETE`` (JSON: step, whether it holds model weights
only, the world size that wrote it). ``COMPLETE`` is written last, by rank 0, after every rank's
data and the metadata are on disk: a folder without it is a save that did not finish, which
readers ignore and rank 0 deletes.

The decisions here take the result of ``scan`` and return what to do; the manager does it (the
deleting, renaming and loading, and the collectives around them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.checkpoint import storage
from torchtitan.checkpoint.errors import CheckpointError
from torchtitan.observability.log import logger
from torchtitan.remote import StorageError, access_problem

MARKER = "COMPLETE"


@dataclass(frozen=True)
class Found:
    """A checkpoint folder and what its marker says (``complete`` False: no marker)."""

    step: int
    path: str
    complete: bool
    model_only: bool = False


def step_path(folder: str, step: int) -> str:
    """Where the checkpoint of ``step`` lives in ``folder``."""
    return storage.join(folder, f"step-{step}")


def write_marker(
    path: str, step: int, model_only: bool, world_size: int, run: dict[str, Any] | None = None
) -> None:
    """Mark ``path`` complete: the marker is either absent or whole (``storage.write_atomic``).
    ``run``: what a resume must match (``mismatch.run_facts``)."""
    info = {"step": step, "model_only": model_only, "world_size": world_size}
    if run:
        info["run"] = run
    storage.write_atomic(storage.join(path, MARKER), json.dumps(info).encode())


def read_marker(path: str) -> dict[str, Any]:
    """What the marker in ``path`` says; ``{}`` when there is none or it cannot be read (an
    unreadable marker is no marker)."""
    try:
        data = storage.read_bytes(storage.join(path, MARKER))
        info = json.loads(data) if data is not None else {}
    except ValueError:
        return {}
    except Exception as e:
        if storage.is_url(path):  # storage that fails to answer is not a missing marker
            problem = access_problem(e) or f"{type(e).__name__}: {e}"
            raise StorageError(f"checkpoint {path}: its {MARKER} cannot be read: {problem}") from e
        if not isinstance(e, OSError):
            raise
        return {}
    return info if isinstance(info, dict) else {}


def scan(folder: str) -> list[Found]:
    """Every ``step-N`` folder under ``folder``, oldest first."""
    found = []
    for name in storage.list_dirs(folder):
        if not (name.startswith("step-") and name[5:].isdigit()):
            continue
        path = storage.join(folder, name)
        info = read_marker(path)
        found.append(Found(int(name[5:]), path, bool(info), bool(info.get("model_only", False))))
    return sorted(found, key=lambda c: c.step)


# ----------------------------------------------------------------------------- decisions


def resume_candidates(complete: list[Found]) -> tuple[list[Found], list[Found]]:
    """Auto-resume: the complete checkpoints that are resume points (full training state, or a
    model-only seed at step 0), oldest first, and the model-only ones skipped."""
    candidates = [c for c in complete if not c.model_only or c.step == 0]
    return candidates, [c for c in complete if c not in candidates]


def requested(complete: list[Found], step: int, folder: str) -> Found:
    """``checkpoint.load_step``: the complete checkpoint of ``step``, else CheckpointError."""
    match = [c for c in complete if c.step == step]
    if not match:
        have = ", ".join(str(c.step) for c in complete) or "none"
        raise CheckpointError(
            f"checkpoint.load_step: no complete checkpoint for step {step} in {folder} "
            f"(complete steps: {have})"
        )
    return match[0]


def fall_back(
    candidates: list[Found], load: Callable[[Found], None]
) -> tuple[Found | None, list[Found]]:
    """Load the newest candidate that loads, falling back past damaged ones; returns it (None
    when there are no candidates) and the ones that failed. ``load`` raises CheckpointError for
    a checkpoint that cannot be loaded; the oldest candidate's error is raised, there is nothing
    left to fall back to."""
    failed: list[Found] = []
    for c in reversed(candidates):
        try:
            load(c)
        except CheckpointError as e:
            failed.append(c)
            if c is candidates[0]:
                raise
            logger.warning(f"{e}; falling back to the checkpoint before it")
            continue
        return c, failed
    return None, failed


def set_aside(complete: list[Found], start: int, failed: list[Found]) -> list[tuple[Found, str]]:
    """The run continues from step ``start``: the complete checkpoints of later steps belong to
    another history and are renamed, each with its suffix (``unloadable`` for one that failed to
    load, else ``superseded``)."""
    return [(c, "unloadable" if c in failed else "superseded") for c in complete if c.step > start]


def to_purge(found: list[Found], keep_latest_k: int, keep: str) -> list[Found]:
    """Retention: the complete checkpoints beyond the newest ``keep_latest_k`` of each kind
    (resumable, then model weights only), never ``keep`` (the one just written); incomplete
    folders are not counted or removed here. ``keep_latest_k`` <= 0 keeps all."""
    if keep_latest_k <= 0:
        return []
    complete = [c for c in found if c.complete]
    purge = []
    for model_only in (False, True):
        same_kind = [c for c in complete if c.model_only == model_only]
        for old in same_kind[:-keep_latest_k]:
            if not _same(old.path, keep):
                purge.append(old)
    return purge


def _same(a: str, b: str) -> bool:
    """Whether two checkpoint paths name the same folder (URLs as written, local paths resolved)."""
    if storage.is_url(a) or storage.is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    return os.path.abspath(a) == os.path.abspath(b)
