"""Free localhost TCP ports for the servers the tests start (moto's S3, torchft's lighthouse,
Slurm's daemons)."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now: all held open at once while asked, so none repeats."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]
