"""Will the job fit: the memory a device has against what the job needs of it.

Two predictions, a floor and an estimate:

- :func:`state_floor_gib`, instant, from the parameter count alone: every parameter's float32
  value (FSDP keeps float32 shards and casts for compute), its float32 gradient (none with
  ``optimizer.early_step_in_backward``) and the optimizer's moments (two per parameter for
  Adam/AdamW, one per hidden matrix for Muon: counted as one, the least; in
  ``optimizer.state_dtype``), spread evenly over every device of the job. No layout holds less
  on its fullest device, so a floor above the device's memory is a job that cannot fit, whatever
  the degrees. The launcher's preflight checks it for every CUDA job.
- the traced peak of ``scripts/estimate_memory.py`` (one step on fake tensors), with the
  activations, for one layout; it prints the same verdict.

The device's memory is what CUDA reports on the machine that runs the check, or the table's
(``torchtitan/devices.py``) for ``--gpu-type`` (a login node planning for another machine), or
``--device-memory-gib``. ``RESERVE_GIB`` is kept for what neither prediction counts: the CUDA
context, NCCL's buffers and the caching allocator's slack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchtitan.config.schema import JobConfig
from torchtitan.devices import DEVICES, device_by_key, find_device
from torchtitan.errors import ConfigError

GIB = 1024**3
# the CUDA context (~0.5 GiB), NCCL's buffers and the allocator's slack; an assumption until a
# GPU session measures it (docs/planning.md)
RESERVE_GIB = 2.0


@dataclass(frozen=True)
class DeviceMemory:
    gib: float  # what a process may use
    label: str  # where the figure comes from, for the verdict's line


def device_memory(
    device_type: str, gpu_type: str | None = None, memory_gib: float | None = None
) -> DeviceMemory | None:
    """The memory of the job's devices: ``--device-memory-gib``, else ``--gpu-type``'s entry,
    else this machine's smallest CUDA device; None when unknown (a CPU job, or CUDA planned
    from a machine without a GPU and no type given)."""
    if memory_gib is not None:
        memory_gib = checked_memory_gib(memory_gib)
        return DeviceMemory(memory_gib, f"{memory_gib:g} GiB (--device-memory-gib)")
    if gpu_type is not None:
        device = device_by_key(gpu_type)
        return DeviceMemory(device.memory_gib, f"{device.memory_gib:.1f} GiB of one {device.key}")
    if device_type == "cuda":
        try:
            if not torch.cuda.is_available():
                return None
            props = min(
                (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())),
                key=lambda p: p.total_memory,
            )
        except (RuntimeError, ValueError):  # a driver that does not answer: as without one
            return None
        known = find_device(props.name)
        name = known.key if known else props.name
        gib = props.total_memory / GIB
        return DeviceMemory(gib, f"{gib:.1f} GiB of one {name}")
    return None


def checked_memory_gib(value: float | str) -> float:
    """``--device-memory-gib``'s value: a number of GiB above the reserve."""
    try:
        gib = float(value)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > RESERVE_GIB):
        raise ConfigError(
            f"--device-memory-gib: {value!r} must be a number of GiB above the {RESERVE_GIB:g} "
            "kept for the CUDA context"
        )
    return gib


def largest_device() -> DeviceMemory:
    device = max(DEVICES, key=lambda d: d.memory_gib)
    return DeviceMemory(
        device.memory_gib,
        f"{device.memory_gib:.1f} GiB of one {device.key}, the largest GPU listed",
    )


def state_floor_gib(
    job_config: JobConfig, model: torch.nn.Module, world_size: int, weights_only: bool = False
) -> float:
    """GiB per device that the model's parameters, gradients and optimizer state take at the
    least (spread evenly over ``world_size`` devices); ``weights_only``: the parameters alone
    (a seed checkpoint's job, which never steps)."""
    if weights_only:
        return 4 * sum(p.numel() for p in model.parameters()) / world_size / GIB
    total = trainable = 0
    for p in model.parameters():
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    _, grads, moments = state_bytes(job_config)
    return (4 * total + (grads + moments) * trainable) / world_size / GIB


def state_bytes(job_config: JobConfig) -> tuple[int, int, int]:
    """Bytes per parameter at the least: its float32 weight, and for a trained one its float32
    gradient (none with ``optimizer.early_step_in_backward``) and the optimizer's moments (two
    for Adam/AdamW, one counted for Muon, in ``optimizer.state_dtype``)."""
    opt = job_config.optimizer
    grads = 0 if opt.early_step_in_backward else 4
    moments = (1 if opt.name == "Muon" else 2) * (2 if opt.state_dtype == "bfloat16" else 4)
    return 4, grads, moments


def verdict(need_gib: float, memory: DeviceMemory, what: str) -> tuple[bool, str]:
    """Whether ``need_gib`` (+ the reserve) fits in ``memory``, and the line saying so."""
    fits = need_gib + RESERVE_GIB <= memory.gib
    line = (
        f"{'fits' if fits else 'does not fit'}: {what} {need_gib:,.1f} GiB per device "
        f"(+ {RESERVE_GIB:g} GiB kept for the CUDA context and NCCL) against {memory.label}"
    )
    return fits, line
