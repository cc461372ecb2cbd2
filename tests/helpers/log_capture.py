"""The lines the ``torchtitan`` logger emits during a block, whatever its handlers and level."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def logged(level: int = logging.INFO, *, with_level: bool = False) -> Iterator[list[str]]:
    """Yields a list that gathers each record's message (``"LEVEL message"`` with
    ``with_level``) at ``level`` or above until the block ends."""
    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            lines.append(f"{record.levelname} {message}" if with_level else message)

    log = logging.getLogger("torchtitan")
    handler, previous = _Collect(level=level), log.level
    log.addHandler(handler)
    log.setLevel(min(level, previous) if previous else level)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)
