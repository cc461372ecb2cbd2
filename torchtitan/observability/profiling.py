"""Profiler traces and CUDA memory snapshots over training steps, switched on by ``[profiling]``.

Every ``profile_freq`` steps, the last ``profiler_active`` steps (after ``profiler_warmup`` steps
of warm-up) are traced by ``torch.profiler``; each rank writes a Chrome trace (open it in
Perfetto or chrome://tracing) to ``{dump_folder}/{save_traces_folder}/iteration_{step}/
rank{rank}_trace.json``. On CUDA, ``enable_memory_snapshot`` records allocator history and writes
``{dump_folder}/{save_memory_snapshot_folder}/iteration_{step}/rank{rank}_memory_snapshot.pickle``
every ``profile_freq`` steps, and ``oom/`` when a step runs out of memory (open them at
https://pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
import warnings
from collections.abc import Iterator

import torch

from torchtitan.config.schema import Profiling
from torchtitan.distributed.utils import device_type
from torchtitan.observability.log import logger

_SNAPSHOT_ENTRIES = 100_000  # allocator events kept (the newest)


class StepProfiler:
    """A step hook: ``after_step(n)`` after each training step ``n``; traces and snapshots follow
    the schedule."""

    def __init__(self, cfg: Profiling, dump: str, rank: int, last_step_done: int) -> None:
        self.freq, self.rank, self.step_done = cfg.profile_freq, rank, last_step_done
        self.trace_folder = os.path.join(dump, cfg.save_traces_folder)
        self.snapshot_folder = os.path.join(dump, cfg.save_memory_snapshot_folder)
        self.torch_profiler = self._start_profiler(cfg) if cfg.enable_profiling else None
        self.snapshots = cfg.enable_memory_snapshot and device_type == "cuda"
        if cfg.enable_memory_snapshot and not self.snapshots:
            logger.warning(
                "profiling.enable_memory_snapshot: CUDA memory snapshots need a GPU; none are "
                "written on this CPU run"
            )
        if self.snapshots:
            torch.cuda.memory._record_memory_history(max_entries=_SNAPSHOT_ENTRIES)

    def _start_profiler(self, cfg) -> torch.profiler.profile:
        active, warmup = cfg.profiler_active, cfg.profiler_warmup
        # the traced steps end on multiples of profile_freq, also when resuming mid-cycle
        schedule = torch.profiler.schedule(
            skip_first=(-self.step_done) % self.freq,
            wait=self.freq - warmup - active,
            warmup=warmup,
            active=active,
        )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        logger.info(
            f"Profiling steps {self.freq - active + 1}..{self.freq} of every {self.freq} "
            f"(traces in {self.trace_folder})"
        )
        # each cycle's trace holds that cycle's steps only: what the cleared-events warning is about
        warnings.filterwarnings(
            "ignore", message=".*Profiler clears events at the end of each cycle"
        )
        profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._write_trace
        )
        profiler.start()
        return profiler

    def _write_trace(self, profiler: torch.profiler.profile) -> None:
        t0 = time.perf_counter()
        folder = os.path.join(self.trace_folder, f"iteration_{self.step_done}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_trace.json")
        profiler.export_chrome_trace(path)
        logger.info(f"Profiler trace written to {path} in {time.perf_counter() - t0:.2f}s")

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        self.step_done = step
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        if self.snapshots and step % self.freq == 0:
            self._write_snapshot(f"iteration_{step}")

    def _write_snapshot(self, name: str) -> None:
        folder = os.path.join(self.snapshot_folder, name)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{self.rank}_memory_snapshot.pickle")
        with open(path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        logger.info(f"Memory snapshot written to {path}")

    def close(self) -> None:
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        if self.snapshots:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshots = False


@contextlib.contextmanager
def profiled_steps(
    cfg: Profiling, dump_folder: str, rank: int, last_step_done: int
) -> Iterator[StepProfiler]:
    """The training loop runs inside: a step that runs out of CUDA memory leaves a snapshot."""
    profiler = StepProfiler(cfg, dump_folder, rank, last_step_done)
    try:
        yield profiler
    except torch.OutOfMemoryError:
        if profiler.snapshots:
            profiler._write_snapshot("oom")
        raise
    finally:
        profiler.close()
