"""The cost model's rates for CPU processes, from this machine's measurements.

``torchrun --nproc-per-node N benchmarks/ceilings.py --collectives --json`` measures, with all
N processes running at once (so sharing the cores as training's processes do): the matmul
FLOP/s and copy bandwidth one process gets, and gloo's all-gather bandwidth and the time of a
one-element all-reduce (the latency). :func:`cpu_hardware` reads that JSON. A CPU has no
datasheet peak: the measured matmul rate is the peak, reached at efficiency 1, and attention
(its math on CPU is matmuls too) the same.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from torchtitan.errors import ConfigError
from torchtitan.planning.cost import Hardware

# what a CPU training process holds beside the step (tokenizer, dataset rows, the loader's
# buffers, process groups): measured at ~0.07 GiB, tests/e2e/test_estimate_memory.py
CPU_RUNTIME_GIB = 0.07


def cpu_hardware(
    path: str, world: int, devices_per_node: int | None = None, memory_gib: float | None = None
) -> Hardware:
    try:
        measured = json.loads(Path(path).read_text())
        procs = int(measured["world_size"])
        flops = float(measured["matmul"]["tflops"]) * 1e12
        copy = float(measured["copy"]["gb_per_s"]) * 1e9
        gather = float(measured["all_gather"]["gb_per_s"]) * 1e9
        latency = float(measured["all_reduce_latency_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"--calibration: {path!r} is not the JSON of torchrun benchmarks/ceilings.py "
            f"--collectives --json ({type(e).__name__}: {e})"
        ) from None
    if procs != world:
        raise ConfigError(
            f"--calibration: {path!r} was measured with {procs} processes, the plan is for "
            f"{world}; measure with --nproc-per-node {world} (processes share the cores)"
        )
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3 / world
    return Hardware(
        name="cpu process",
        peak_flops=flops,
        matmul_efficiency=1.0,
        attention_efficiency=1.0,
        hbm_bytes_s=copy,
        link_bytes_s=gather,
        network_bytes_s=gather,
        devices_per_node=devices_per_node or world,
        latency_s=latency,
        memory_gib=memory_gib,
        source=f"measured here with {procs} processes ({path})",
        compute_bytes=4,  # float32 on CPU (distributed/data_parallel.py: param_dtype)
        overlap=False,
        reserve_gib=0.0,
        runtime_gib=CPU_RUNTIME_GIB,
        idle_lends_cores=procs > (os.cpu_count() or 1),
    )
