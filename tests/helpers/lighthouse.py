"""torchft's lighthouse for the replica-group tests: the real ``torchft_lighthouse`` program
(installed with torchft beside this Python), started on a free localhost port by the test and
stopped by its process id. Groups find it through ``TORCHFT_LIGHTHOUSE``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from ports import free_port


@contextmanager
def lighthouse(min_replicas: int, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 2000):
    """A running lighthouse; yields the environment that points a group at it."""
    port = free_port()
    exe = Path(sys.executable).parent / "torchft_lighthouse"
    proc = subprocess.Popen(
        [
            str(exe),
            "--min_replicas",
            str(min_replicas),
            "--bind",
            f"[::]:{port}",
            "--join_timeout_ms",
            str(join_timeout_ms),
            "--heartbeat_timeout_ms",
            str(heartbeat_timeout_ms),
            "--quorum_tick_ms",
            "50",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("torchft_lighthouse did not start") from None
                time.sleep(0.1)
        yield {"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}"}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
