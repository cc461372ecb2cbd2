"""The two ceilings of this device: dense matmul FLOP/s and memory copy bandwidth.

    python benchmarks/ceilings.py [--size 8192] [--copy-gib 4] [--dtype bfloat16] [--json]
    torchrun --nproc-per-node N benchmarks/ceilings.py --collectives [--json]

Matmul: ``C = A @ B`` for square ``size x size`` matrices, ``2 * size**3`` FLOPs per call. Copy: a
``copy-gib`` GiB tensor copied device to device, counted as read plus write (2 x bytes). Each is
the median of ``--repeats`` timed calls after warm-up; on CUDA timed with events. On CPU the
defaults shrink (float32, size 2048, 0.5 GiB). MFU in docs/performance.md is relative to the
datasheet peak, not to this measured ceiling; both are reported there.

``--collectives`` (under torchrun): every process measures at the same time, so the rates are
those one process gets while the others run (on CPU the processes share the cores, as training's
do), then the job's collectives are timed: an all-gather of ``--gather-mib`` MiB per rank
(reported as the bytes each rank receives per second) and a one-element all-reduce (the
latency), over gloo on CPU and NCCL on CUDA. Rank 0 prints the result, with ``world_size``; the
layout planner reads it for CPU processes (``python -m torchtitan.plan --device-type cpu
--calibration FILE``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def main() -> int:
    import torch

    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192 if cuda else 2048)
    parser.add_argument("--copy-gib", type=float, default=4.0 if cuda else 0.5)
    parser.add_argument("--dtype", default="bfloat16" if cuda else "float32")
    parser.add_argument("--repeats", type=int, default=20 if cuda else 5)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--collectives", action="store_true", help="under torchrun: see above")
    parser.add_argument("--gather-mib", type=float, default=64.0 if cuda else 16.0)
    a = parser.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.collectives:
        return _with_collectives(a, dtype, cuda)
    flops, copy_bytes = _rates(a, torch.device("cuda" if cuda else "cpu"), dtype, cuda)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "matmul": {"size": a.size, "dtype": a.dtype, "tflops": flops / 1e12},
        "copy": {"gib": a.copy_gib, "gb_per_s": copy_bytes / 1e9},
    }
    if a.json:
        print(json.dumps(result))
    else:
        print(f"device: {result['device']}")
        print(f"  matmul {a.size}x{a.size} {a.dtype}: {result['matmul']['tflops']:.1f} TFLOP/s")
        print(f"  copy {a.copy_gib} GiB (read + write): {result['copy']['gb_per_s']:.0f} GB/s")
    return 0


def _with_collectives(a, dtype, cuda: bool) -> int:
    """Every rank measures at once; then the collectives; rank 0 prints."""
    import os

    import torch
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        print("error: --collectives runs under torchrun (torchrun --nproc-per-node N ...)")
        return 2
    rank = int(os.environ["RANK"])
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        flops, copy_bytes = _rates(a, device, dtype, cuda, start=dist.barrier)
        world = dist.get_world_size()
        piece = torch.ones(int(a.gather_mib * 1024**2) // 2, device=device, dtype=torch.bfloat16)
        whole = torch.empty(world * piece.numel(), device=device, dtype=torch.bfloat16)
        dist.barrier()
        gather_s = _time(lambda: dist.all_gather_into_tensor(whole, piece), a.repeats, cuda)
        one = torch.ones(1, device=device)
        latency_s = _time(lambda: dist.all_reduce(one), 4 * a.repeats, cuda)
        rates = torch.tensor([flops, copy_bytes], dtype=torch.float64)
        rates = rates.to(device)
        dist.all_reduce(rates, op=dist.ReduceOp.MIN)  # the slowest rank's
        rates = rates.cpu()
    finally:
        dist.destroy_process_group()
    received = (world - 1) * piece.numel() * 2
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "world_size": world,
        "threads": torch.get_num_threads(),
        "matmul": {"size": a.size, "dtype": a.dtype, "tflops": rates[0].item() / 1e12},
        "copy": {"gib": a.copy_gib, "gb_per_s": rates[1].item() / 1e9},
        "all_gather": {"mib_per_rank": a.gather_mib, "gb_per_s": received / gather_s / 1e9},
        "all_reduce_latency_s": latency_s,
    }
    if rank == 0:
        if a.json:
            print(json.dumps(result))
        else:
            print(f"{world} processes on {result['device']}, each while all run:")
            print(f"  matmul {a.size}x{a.size} {a.dtype}: {result['matmul']['tflops']:.3f} TFLOP/s")
            print(f"  copy: {result['copy']['gb_per_s']:.1f} GB/s (read + write)")
            print(
                f"  all-gather {a.gather_mib:g} MiB per rank: {result['all_gather']['gb_per_s']:.2f} GB/s received"
            )
            print(f"  all-reduce of one element: {1e6 * latency_s:.0f} us")
    return 0


def _rates(a, device, dtype, cuda: bool, start=lambda: None) -> tuple[float, float]:
    """(matmul FLOP/s, copy bytes/s read and written) on ``device``; ``start`` runs before
    each is timed (a barrier, so that every rank measures at once)."""
    import torch

    x = torch.randn(a.size, a.size, device=device, dtype=dtype)
    y = torch.randn(a.size, a.size, device=device, dtype=dtype)
    start()
    mm_s = _time(lambda: torch.mm(x, y), a.repeats, cuda)
    n = int(a.copy_gib * 1024**3) // 4
    src = torch.ones(n, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    start()
    copy_s = _time(lambda: dst.copy_(src), a.repeats, cuda)
    return 2 * a.size**3 / mm_s, 2 * n * 4 / copy_s


def _time(fn, repeats: int, cuda: bool) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
