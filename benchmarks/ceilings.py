"""The two ceilings of this device: dense matmul FLOP/s and memory copy bandwidth.

    python benchmarks/ceilings.py [--size 8192] [--copy-gib 4] [--dtype bfloat16] [--json]

Matmul: ``C = A @ B`` for square ``size x size`` matrices, ``2 * size**3`` FLOPs per call. Copy: a
``copy-gib`` GiB tensor copied device to device, counted as read plus write (2 x bytes). Each is
the median of ``--repeats`` timed calls after warm-up; on CUDA timed with events. On CPU the
defaults shrink (float32, size 2048, 0.5 GiB). MFU in docs/performance.md is relative to the
datasheet peak, not to this measured ceiling; both are reported there.
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
    a = parser.parse_args()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, a.dtype)

    x = torch.randn(a.size, a.size, device=device, dtype=dtype)
    y = torch.randn(a.size, a.size, device=device, dtype=dtype)
    mm_s = _time(lambda: torch.mm(x, y), a.repeats, cuda)
    n = int(a.copy_gib * 1024**3) // 4
    src = torch.empty(n, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _time(lambda: dst.copy_(src), a.repeats, cuda)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "matmul": {"size": a.size, "dtype": a.dtype, "tflops": 2 * a.size**3 / mm_s / 1e12},
        "copy": {"gib": a.copy_gib, "gb_per_s": 2 * n * 4 / copy_s / 1e9},
    }
    if a.json:
        print(json.dumps(result))
    else:
        print(f"device: {result['device']}")
        print(f"  matmul {a.size}x{a.size} {a.dtype}: {result['matmul']['tflops']:.1f} TFLOP/s")
        print(f"  copy {a.copy_gib} GiB (read + write): {result['copy']['gb_per_s']:.0f} GB/s")
    return 0


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
