"""A checkpoint save that failed (disk full, permission, I/O error): what it is, and the one line
that says so (``checkpoint.on_save_error``). The manager decides when every rank has heard of it;
this module only describes it.

A failed save never touches the previous complete checkpoint: nothing is purged before a new
one is marked, and the failed folder, never marked, is removed (or, if it cannot be, ignored by
every reader as an unfinished save).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan.checkpoint.collectives import _first_line
from torchtitan.remote import is_url

STOP, CONTINUE = "stop", "continue"


@dataclass(frozen=True)
class SaveFailure:
    """The save of ``step`` into ``path`` failed with ``error`` (one line); ``logged``: the rank
    that holds it already logged it (a background save, when it found out)."""

    path: str
    step: int
    error: str
    logged: bool = False


class _DiskErrors:
    """DCP's file writer, whose errors say what the disk said. torch's serializer reports a
    failed write (ENOSPC, EIO) as ``RuntimeError: [enforce fail at inline_container.cc] ...
    unexpected pos``, the OSError only as its context, which DCP's gathering of the ranks' errors
    drops (it pickles them): the OSError is raised in its place."""

    def write_data(self, plan: Any, planner: Any) -> Future:
        try:
            return super().write_data(plan, planner)
        except Exception as e:
            os_error = _os_error(e)
            if os_error is None or os_error is e:
                raise
            raise OSError(os_error.errno, os_error.strerror, os_error.filename) from e


class Writer(_DiskErrors, FileSystemWriter):
    pass


class UrlWriter(_DiskErrors, FsspecWriter):
    """The writer into object storage (a URL). No fsync: a file there has none, and torch's
    fall-back for it is a machine-wide ``os.sync()`` per file; an object is whole once written."""

    def __init__(self, path: str) -> None:
        super().__init__(path, sync_files=False)


def writer_for(path: str) -> FileSystemWriter:
    """DCP's writer for the checkpoint folder ``path``: a local folder or a URL."""
    return UrlWriter(path) if is_url(path) else Writer(path)


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e``: ``e`` itself or the first in its chain of causes."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, OSError):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def describe(e: BaseException, world_size: int = 1) -> str:
    """One line for what made a save fail. DCP gathers every rank's write error into one
    ``CheckpointException`` raised on all ranks: the lowest failing rank's error is told, and
    (with several ranks) which ranks failed: a single one points at its node's disk."""
    if isinstance(e, CheckpointException) and e.failures:
        ranks = sorted(e.failures)
        text = _one_error(e.failures[ranks[0]][0])
        if world_size == 1:
            return text
        named = ", ".join(str(r) for r in ranks[:4]) + (
            f" and {len(ranks) - 4} more" * (len(ranks) > 4)
        )
        return f"{text} (rank{'s' * (len(ranks) > 1)} {named})"
    return _one_error(e)


def _one_error(e: BaseException) -> str:
    """``[Errno 28] No space left on device`` for an OSError (its own words say what it is),
    else the type and the first line of the message."""
    if isinstance(e, OSError):
        return _first_line(e) or type(e).__name__
    return f"{type(e).__name__}: {_first_line(e)}"


def stop_line(failure: SaveFailure, newest: str | None) -> str:
    """The error a run stops with (``on_save_error = "stop"``)."""
    return (
        f"checkpoint save to {failure.path} failed: {failure.error}; {_kept(newest)}; free space "
        "(or fix what the error names) and start again to resume, or set "
        'checkpoint.on_save_error = "continue" to train on when a save fails'
    )


def continue_line(failure: SaveFailure, newest: str | None, last: bool = False) -> str:
    """The line logged when training goes on (``on_save_error = "continue"``); ``last``: the
    save of the last step, after which there is no next one."""
    goes_on = (
        "the run ends without it" if last else "training goes on and the next save tries again"
    )
    return (
        f"checkpoint save to {failure.path} failed: {failure.error}; {goes_on} "
        f'(checkpoint.on_save_error = "continue"); {_kept(newest)}'
    )


def found_line(
    failure: SaveFailure, on_save_error: str, newest: str | None, last: bool = False
) -> str:
    """What a rank logs when it finds that its background save failed. With "stop" the run
    stops where every rank waits for that save anyway (the next save, a save before exit, the
    end of training): the ranks find out at different steps and must stop at the same one."""
    if on_save_error == CONTINUE:
        return continue_line(failure, newest, last)
    return (
        f"checkpoint save to {failure.path} failed: {failure.error}; the run stops at its next "
        'save or its end, where every rank waits for it (checkpoint.on_save_error = "stop")'
    )


def _kept(newest: str | None) -> str:
    if newest is None:
        return "there is no complete checkpoint yet"
    return f"the newest complete checkpoint, {newest}, is kept"
