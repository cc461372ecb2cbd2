"""Per-process run state: seeds and determinism, garbage collection, start-up timing."""

from __future__ import annotations

import gc
import os
import random
import time

import torch
import torch.distributed as dist

_IMPORTED_AT = time.perf_counter()


def resolve_seed(seed: int | None, device: torch.device) -> int:
    """The configured seed, or one drawn on rank 0 and shared with every rank."""
    if seed is not None:
        return seed
    drawn = torch.tensor([random.SystemRandom().randrange(2**32)], dtype=torch.int64, device=device)
    if dist.is_initialized():
        dist.broadcast(drawn, src=0)
    return int(drawn.item())


def set_determinism(seed: int, deterministic: bool, rank_offset: int = 0) -> None:
    """Seed Python, NumPy and torch. ``rank_offset`` makes per-rank streams differ where they must.

    Seeds stay inside [0, 2**32): NumPy rejects larger ones, so the per-rank seed wraps around.
    """
    s = (seed + rank_offset) % 2**32
    random.seed(s)
    try:
        import numpy as np

        np.random.seed(s)
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(s)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class GarbageCollection:
    """Turn off automatic GC (its pauses are random across ranks) and collect every ``freq`` steps."""

    def __init__(self, freq: int):
        self.freq = freq
        gc.disable()
        gc.collect(1)

    def before_step(self, step: int) -> None:
        if step > 1 and step % self.freq == 0:
            gc.collect(1)

    def after_step(self, step: int) -> None:
        pass


def process_age() -> float:
    """Seconds since this process started (Linux ``/proc``), else since this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED_AT


class StartupTimer:
    """Where the time from process start to the first finished step goes, phase by phase."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = [("start and imports", process_age())]
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def summary(self) -> str:
        total = sum(s for _, s in self.phases)
        parts = ", ".join(f"{name} {s:.2f}s" for name, s in self.phases)
        return f"Start-up {total:.2f}s, process start to the end of the first step ({parts})"
