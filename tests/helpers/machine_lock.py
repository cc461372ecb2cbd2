"""The machine shared between test workers, or held by one test alone.

``machine(folder, alone)`` is a readers-writer lock over two files in ``folder``, taken with
``flock`` so that it holds between processes (pytest-xdist's workers): any number of holders
share the machine, and one that asks for it ``alone`` waits until they have left and keeps
every later one out until it is done. The writer first takes a turnstile that every holder
passes through on the way in, so a waiting ``alone`` is not starved by a stream of sharers.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def machine(folder: Path, alone: bool) -> Iterator[None]:
    with open(folder / "turnstile", "a") as turnstile, open(folder / "room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)  # held by an `alone` until it is in
        try:
            fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)
