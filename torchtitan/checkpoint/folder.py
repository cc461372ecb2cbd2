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

from torchtitan.checkpoint.errors import CheckpointError
from torchtitan.observability.log import logger

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
    return os.path.join(folder, f"step-{step}")


def write_marker(
    path: str, step: int, model_only: bool, world_size: int, run: dict[str, Any] | None = None
) -> None:
    """Mark ``path`` complete: written to a temporary name, fsynced, then renamed, so that the
    marker is either absent or whole. ``run``: what a resume must match (``mismatch.run_facts``)."""
    info = {"step": step, "model_only": model_only, "world_size": world_size}
    if run:
        info["run"] = run
    tmp = os.path.join(path, f".{MARKER}.tmp")
    with open(tmp, "w") as f:
        json.dump(info, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, MARKER))


def read_marker(path: str) -> dict[str, Any]:
    """What the marker in ``path`` says; ``{}`` when there is none or it cannot be read (an
    unreadable marker is no marker)."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        return {}
    try:
        with open(marker) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def scan(folder: str) -> list[Found]:
    """Every ``step-N`` folder under ``folder``, oldest first."""
    found = []
    if not os.path.isdir(folder):
        return found
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if not (name.startswith("step-") and name[5:].isdigit() and os.path.isdir(path)):
            continue
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
            if os.path.abspath(old.path) != os.path.abspath(keep):
                purge.append(old)
    return purge
