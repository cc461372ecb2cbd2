"""Shared by the conversion and generation scripts: progress lines and one-line errors."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_T0 = time.perf_counter()


def progress(what: str):
    """A ``(done, total)`` callback printing ``what: done/total (elapsed)`` to stderr."""

    def report(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            print(f"{what}: {done}/{total} ({time.perf_counter() - _T0:.1f}s)", file=sys.stderr)

    return report


def run(main) -> None:
    """Call ``main()``; a library error becomes ``error: ...`` and exit code 1 (or 2)."""
    from torchtitan.errors import TorchTitanError

    try:
        main()
    except TorchTitanError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
