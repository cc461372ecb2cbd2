"""The library's logger: one line per message, prefixed with the rank when there are several."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("torchtitan")


def init_logger(rank: int | None = None, level: int = logging.INFO) -> None:
    """Send the ``torchtitan`` logger to stdout, tagged with the rank in multi-process runs."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    prefix = f"[rank{rank}] " if world > 1 else ""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    )
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
