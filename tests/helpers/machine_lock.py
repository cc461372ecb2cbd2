"""The machine shared between test workers, or held by one test alone.

``machine(folder, alone)`` is a readers-writer lock over two files in ``folder``, taken with
``flock`` so that it holds between processes (pytest-xdist's workers): any number of holders
share the machine, and one that asks for it ``alone`` waits until they have left and keeps
every later one out until it is done. The writer first takes a turnstile that every holder
passes through on the way in, so a waiting ``alone`` is not starved by a stream of sharers.

``Hold`` is one worker's hold across its tests: a test alone followed by another test alone
keeps the machine for it (``keep_alone``), so a run of them waits once for the other worker's
test in progress, not once each.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path


class Hold:
    """One worker's hold on the machine in ``folder``, test after test."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._room = None  # the room's file, locked, while this worker holds the machine

    @contextlib.contextmanager
    def test(self, alone: bool, keep_alone: bool = False) -> Iterator[None]:
        """Hold the machine for one test: shared, or ``alone``; ``keep_alone`` (the next test
        of this worker is alone too): keep it alone after this one."""
        if not (alone and self._room is not None):
            self.release()
            self._room = self._enter(alone)
        try:
            yield
        finally:
            if not (alone and keep_alone):
                self.release()

    def release(self) -> None:
        """Give up the machine (after a test, or one kept alone at the end of the tests)."""
        if self._room is not None:
            fcntl.flock(self._room, fcntl.LOCK_UN)
            self._room.close()
            self._room = None

    def _enter(self, alone: bool):
        room = open(self.folder / "room", "a")  # noqa: SIM115 (closed when the hold ends)
        with open(self.folder / "turnstile", "a") as turnstile:
            fcntl.flock(turnstile, fcntl.LOCK_EX)  # held by an `alone` until it is in
            try:
                fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            except BaseException:
                room.close()
                raise
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        return room


@contextlib.contextmanager
def machine(folder: Path, alone: bool) -> Iterator[None]:
    """One hold for one test (``Hold`` without carrying it over)."""
    with Hold(folder).test(alone):
        yield
