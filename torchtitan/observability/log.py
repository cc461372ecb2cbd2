"""The library's logger: one line per message on stdout."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("torchtitan")


def init_logger(level: int = logging.INFO) -> None:
    """Send the ``torchtitan`` logger to stdout (torchrun's ``--tee`` tags each line with its rank)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False


def add_log_file(path: str) -> None:
    """Also write this process's messages, with dates, to ``path`` (appended: a resumed or
    restarted job keeps one file per rank)."""
    import os

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
