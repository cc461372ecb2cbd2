"""RMSNorm implementations (``model.norm_type``): forward and forward+backward time, bandwidth.

Usage::

    python benchmarks/rmsnorm.py [--shapes 8192x4096,8192x2048] [--dtypes bfloat16] \\
        [--impls rmsnorm,compiled_rmsnorm,fused_rmsnorm] [--device cuda|cpu] [--json]

Each implementation is the module the model builds (:func:`torchtitan.models.common.norms.rmsnorm.build_norm`),
in the given dtype (input and weight), on an input of the given ``rows x width`` shape. Times are
medians from ``torch.utils.benchmark.Timer.blocked_autorange`` (which synchronizes CUDA) after
warm-up calls (these also compile ``compiled_rmsnorm``):

* forward: ``norm(x)`` with autograd on, as in training (it records what backward needs);
* forward+backward: ``torch.autograd.grad(norm(x), (x, weight), dy)``.

GB/s is the minimum traffic divided by the time: forward reads ``x`` and writes ``y``
(``2 x rows x width`` elements), forward+backward adds reading ``x`` and ``dy`` and writing
``dx`` (``5 x rows x width`` in all); the weight, the per-row statistics and the weight-gradient
partial sums are left out (under 0.1% at these shapes). An implementation that reads or writes
more (the eager one keeps float32 copies) shows it as lower GB/s.

Defaults: on CUDA (when available) all three implementations (``fused_rmsnorm`` only with
triton installed); on CPU ``rmsnorm`` and ``compiled_rmsnorm``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.utils.benchmark as benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan.models.common.norms.rmsnorm import NORM_TYPES, build_norm  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_shape(text: str) -> tuple[int, int]:
    rows, width = (int(v) for v in text.lower().split("x"))
    return rows, width


def measure(
    impl: str, shape: tuple[int, int], dtype: torch.dtype, device: str, min_run_time: float
) -> dict:
    rows, width = shape
    norm = build_norm(impl, width, 1e-5).to(device, dtype)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(device, dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device, dtype)
    weight = norm.weight

    def forward():
        return norm(x)

    def forward_backward():
        return torch.autograd.grad(norm(x), (x, weight), dy)

    for _ in range(3):  # warm-up: compilation, autotuning, allocator
        forward_backward()
    times = {}
    for name, fn in (("forward", forward), ("forward_backward", forward_backward)):
        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
        times[name] = timer.blocked_autorange(min_run_time=min_run_time).median
    elements = rows * width
    size = torch.empty((), dtype=dtype).element_size()
    fwd_bytes, total_bytes = 2 * elements * size, 5 * elements * size
    return {
        "implementation": impl,
        "shape": [rows, width],
        "dtype": str(dtype).replace("torch.", ""),
        "forward_ms": times["forward"] * 1e3,
        "forward_backward_ms": times["forward_backward"] * 1e3,
        "forward_gbps": fwd_bytes / times["forward"] / 1e9,
        "forward_backward_gbps": total_bytes / times["forward_backward"] / 1e9,
    }


def format_table(result: dict) -> str:
    head = ("implementation", "shape", "dtype", "fwd ms", "fwd+bwd ms", "fwd GB/s", "fwd+bwd GB/s")
    lines = [
        f"device: {result['device_name']}  torch {result['torch']}  threads {result['threads']}",
        f"{head[0]:<18} {head[1]:>11} {head[2]:>9} {head[3]:>9} {head[4]:>11} {head[5]:>9} "
        f"{head[6]:>13}",
    ]
    for r in result["rows"]:
        shape = "x".join(str(s) for s in r["shape"])
        lines.append(
            f"{r['implementation']:<18} {shape:>11} {r['dtype']:>9} {r['forward_ms']:>9.3f} "
            f"{r['forward_backward_ms']:>11.3f} {r['forward_gbps']:>9.1f} "
            f"{r['forward_backward_gbps']:>13.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x4096,8192x2048", help="rows x width, commas")
    parser.add_argument("--dtypes", default="bfloat16", help=f"commas: {', '.join(DTYPES)}")
    parser.add_argument("--impls", default=None, help=f"commas: {', '.join(NORM_TYPES)}")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu")
    )
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds per timing")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = parser.parse_args(argv)

    has_triton = _has_triton()
    if a.impls is None:
        impls = ["rmsnorm", "compiled_rmsnorm"]
        if a.device == "cuda" and has_triton:
            impls.append("fused_rmsnorm")
    else:
        impls = [s.strip() for s in a.impls.split(",") if s.strip()]
    for impl in impls:
        if impl not in NORM_TYPES:
            print(
                f"error: --impls: unknown '{impl}'; valid: {', '.join(NORM_TYPES)}", file=sys.stderr
            )
            return 2
    if "fused_rmsnorm" in impls and (a.device != "cuda" or not has_triton):
        print(
            "error: --impls: fused_rmsnorm needs a CUDA GPU and triton (on CPU it would time its "
            "PyTorch fallback, not the kernel)",
            file=sys.stderr,
        )
        return 2
    if a.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: no CUDA GPU here", file=sys.stderr)
        return 2
    try:
        shapes = [parse_shape(s) for s in a.shapes.split(",") if s.strip()]
        dtypes = [DTYPES[s.strip()] for s in a.dtypes.split(",") if s.strip()]
    except (ValueError, KeyError) as e:
        print(f"error: --shapes / --dtypes: cannot parse ({e})", file=sys.stderr)
        return 2

    rows = [
        measure(impl, shape, dtype, a.device, a.min_run_time)
        for shape in shapes
        for dtype in dtypes
        for impl in impls
    ]
    result = {
        "device": a.device,
        "device_name": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    print(json.dumps(result) if a.json else format_table(result))
    return 0


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


if __name__ == "__main__":
    sys.exit(main())
