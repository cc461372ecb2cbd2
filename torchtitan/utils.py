"""Device, process group, seeds and garbage collection: the few things every rank sets up once."""

from __future__ import annotations

import gc
import os
import random
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_IMPORTED_AT = time.perf_counter()

# One code path: CUDA + NCCL when there is a GPU, else CPU + gloo.
device_type = "cuda" if torch.cuda.is_available() else "cpu"
dist_backend = "nccl" if device_type == "cuda" else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_device() -> torch.device:
    if device_type == "cuda":
        device = torch.device("cuda", local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(device: torch.device, comm: Any = None, dump_folder: str = ".") -> None:
    """Create the default process group when launched by torchrun (WORLD_SIZE set), with
    ``comm.init_timeout_seconds`` until the first step ends (see :func:`set_train_timeout`)."""
    if "RANK" not in os.environ or dist.is_initialized():
        return
    timeout_s = comm.init_timeout_seconds if comm is not None else 600
    if comm is not None and device_type == "cuda":
        _nccl_flight_recorder(comm, dump_folder)
    kwargs = {}
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart != "0" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # After torchrun restarts the workers, the agent's store still holds the previous
        # attempt's process-group keys, and gloo then connects to dead peers' addresses (seen
        # with torch 2.13: "Connection refused" or a hang). Keys of this attempt get their own
        # prefix.
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        kwargs = {
            "store": dist.PrefixStore(f"torchtitan/attempt_{restart}", store),
            "rank": int(os.environ["RANK"]),
            "world_size": int(os.environ["WORLD_SIZE"]),
        }
    dist.init_process_group(
        backend=dist_backend,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device_type == "cuda" else None,
        **kwargs,
    )


def _nccl_flight_recorder(comm: Any, dump_folder: str) -> None:
    """NCCL keeps its last ``trace_buf_size`` collectives per rank and dumps them on a timeout
    to ``{dump_folder}/{save_traces_folder}/rank_N`` (read with torch's fr_trace tool). Values the
    user exported themselves win."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", str(comm.trace_buf_size))
    if comm.trace_buf_size > 0:
        folder = os.path.join(dump_folder, comm.save_traces_folder)
        os.makedirs(folder, exist_ok=True)
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", os.path.join(folder, "rank_"))


def set_train_timeout(comm: Any) -> None:
    """After the first step (compile, checkpoint loading), collectives get the usually shorter
    ``comm.train_timeout_seconds``."""
    if not dist.is_initialized() or comm.train_timeout_seconds == comm.init_timeout_seconds:
        return
    timeout = timedelta(seconds=comm.train_timeout_seconds)
    for group in [dist.group.WORLD, *_all_groups()]:
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def _all_groups() -> list[Any]:
    return list(dist.distributed_c10d._world.pg_map)


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

    def run(self, step: int) -> None:
        if step > 1 and step % self.freq == 0:
            gc.collect(1)


def device_memory() -> tuple[float, float]:
    """(peak allocated GiB, peak reserved GiB) on this device since the last reset; on CPU the
    process's peak resident set (VmHWM) twice: it includes the interpreter and libraries."""
    if device_type == "cuda":
        gib = 1024**3
        return torch.cuda.max_memory_allocated() / gib, torch.cuda.max_memory_reserved() / gib
    rss = _rss_gib()
    return rss, rss


def reset_peak_memory() -> None:
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return
    try:  # Linux: "5" resets VmHWM to the current resident set
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # elsewhere the peak is since the process started


def _rss_gib() -> float:
    try:
        return proc_status_kib("VmHWM") / 1024**2
    except (OSError, ValueError, StopIteration):
        return float("nan")


def proc_status_kib(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in KiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a plain copy of it if it is a functional collective's result not yet waited for
    (``AsyncCollectiveTensor``, e.g. the TP embedding's reduce-scatter). Handed to compiled code
    as is, its gradient comes back wrong (measured on torch 2.13: the embedding gradient is lost
    under FSDP x TP, backward fails under TP alone). The copy, ``[B, T / tp, dim]`` once per step,
    is where the wait happens."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.clone() if isinstance(t, AsyncCollectiveTensor) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor (sharded, replicated or partial) gathered whole, else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def clip_grad_norm_(
    params: list[torch.Tensor], max_norm: float, pp_group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Clip by the global L2 norm over all parameters, whether plain, DTensor or pipeline-split.

    DTensor gradients (FSDP, TP) give their global norm through ``full_tensor()``; with pipeline
    parallelism each rank holds other parameters, so squared norms are summed over ``pp_group``.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = full_tensor(torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True))
    if pp_group is not None:
        squared = total**2
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


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
