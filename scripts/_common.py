"""Shared by the conversion and generation scripts: progress lines and one-line errors."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def progress(what: str):
    """A ``(done, total)`` callback drawing a progress bar on stderr (plain lines in a log)."""
    from torchtitan.observability.progress import Progress

    return Progress(what, total=1)


def run(main) -> None:
    """Call ``main()``; a library error becomes ``error: ...`` and exit code 1 (or 2)."""
    from torchtitan.errors import TorchTitanError

    try:
        main()
    except TorchTitanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
