"""Where a run stands and what it did: the share done and the time left on each step line, and one
summary block when it ends.

:class:`Progress` keeps the steps' end times (the last ``WINDOW`` logged ones) and gives
``12/60 20%  ETA 0:01:23``: the time left is the remaining steps times the mean step time of that
recent window, so that the first step (compilation, first loads) and a slower start do not skew
it. :func:`summary_lines` renders the end-of-run block from a :class:`Summary`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

WINDOW = 10  # logged steps the time left is estimated from


class Progress:
    """``total``: the run's last step. Call :meth:`mark` when a step is logged."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._ends: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def mark(self, step: int, now: float | None = None) -> None:
        self._ends.append((step, time.perf_counter() if now is None else now))

    def seconds_left(self, step: int) -> float | None:
        """The estimate at ``step``; None until two logged steps give a step time."""
        if step >= self.total:
            return 0.0
        if len(self._ends) < 2:
            return None
        (s0, t0), (s1, t1) = self._ends[0], self._ends[-1]
        if s1 <= s0:
            return None
        return (t1 - t0) / (s1 - s0) * max(0, self.total - step)

    def text(self, step: int) -> str:
        left = self.seconds_left(step)
        eta = "ETA --" if left is None else f"ETA {clock(left)}"
        return f"{step}/{self.total} {100 * step // max(1, self.total)}%  {eta}"


def clock(seconds: float) -> str:
    """``0:01:23``; days as ``2d 3:04:05``."""
    s = max(0, round(seconds))
    days, s = divmod(s, 86400)
    text = f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
    return f"{days}d {text}" if days else text


@dataclass
class Summary:
    """What the block says (``None``: not known or not on)."""

    first_step: int  # this run's first step
    last_step: int  # the last one trained
    tokens_run: int  # tokens trained this run (all ranks)
    tokens_all: int  # since step 1, resumed runs included
    wall_s: float  # this run, start-up included
    train_s: float  # the training loop
    loss: float | None  # the last logged training loss
    validation: tuple[float, float] | None  # (loss, perplexity) of the last evaluation
    tokens_per_s: float | None  # per device, over the steps after the first
    mfu_pct: float | None
    checkpoint: str | None  # the newest complete checkpoint
    hf_export: str | None
    tensorboard: str | None


def summary_lines(s: Summary) -> list[str]:
    steps = s.last_step - s.first_step + 1
    lines = [
        "Run summary",
        f"  steps         {s.first_step}-{s.last_step} this run ({steps:,}), {s.last_step:,} in all",
        f"  tokens        {s.tokens_run:,} this run, {s.tokens_all:,} in all",
        f"  wall time     {clock(s.wall_s)} (training loop {clock(s.train_s)})",
    ]
    if s.loss is not None:
        lines.append(f"  final loss    {s.loss:.4f} (training, step {s.last_step})")
    if s.validation is not None:
        loss, ppl = s.validation
        lines.append(f"  validation    loss {loss:.4f}, perplexity {ppl:,.2f}")
    if s.tokens_per_s is not None:
        mfu = f"{s.mfu_pct:.2f}%" if s.mfu_pct is not None else "n/a"
        lines.append(f"  throughput    {round(s.tokens_per_s):,} tokens/s per device, MFU {mfu}")
    lines.append(f"  checkpoint    {s.checkpoint or 'none (checkpoint.enable is false)'}")
    if s.hf_export:
        lines.append(f"  HF export     {s.hf_export}")
    lines.append(f"  TensorBoard   {s.tensorboard or 'off (metrics.enable_tensorboard)'}")
    return lines
