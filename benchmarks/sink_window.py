"""The cost of gpt-oss attention (a sink per head; every other layer a 128-key window) against
plain causal attention, forward + backward, at sequence 2048 and 8192.

    python benchmarks/sink_window.py [--seqs 2048 8192] [--heads 8] [--kv-heads 1] [--rounds 3]
                                     [--threads N] [--json]

Rows, one attention call on ``q [1, heads, T, 64]``, ``k, v [1, kv_heads, T, 64]`` (gpt-oss has
64 query heads over 8 kv heads of width 64; the default keeps its 8:1 grouping with fewer heads):

* ``causal``: SDPA ``is_causal``, no sink: the baseline, 1.00.
* ``causal + sinks``: the full layers' kernel (``CausalAttention`` with ``sinks``): SDPA with the
  sink folded in as one more key, under a ``T x (T + 1)`` mask.
* ``window 128 + sinks``: the sliding layers' kernel: queries in chunks of 128, each over its own
  and the previous chunk, so ``T x 256`` scores instead of ``T x T``.
* ``written out``: the oracle of the tests (``sink_attention``, every score materialized), at
  the shorter sequences only (``--oracle-max``).

On CPU the ms are the median over ``--rounds`` of the process's CPU time per call, the rows
alternating within each round; on CUDA wall time around ``torch.cuda.synchronize``. ``x causal``
is the row's time over the baseline's at the same length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan.models.common.attention import CausalAttention  # noqa: E402
from torchtitan.models.common.sink_window import sink_attention, sliding_window_mask  # noqa: E402

WINDOW = 128
HEAD_DIM = 64


def _rows(t: int, oracle_max: int) -> dict[str, Callable]:
    kernel = CausalAttention()
    rows: dict[str, Callable] = {
        "causal": lambda q, k, v, s: kernel(q, k, v),
        "causal + sinks": lambda q, k, v, s: kernel(q, k, v, sinks=s),
        f"window {WINDOW} + sinks": lambda q, k, v, s: kernel(q, k, v, sinks=s, window=WINDOW),
    }
    if t <= oracle_max:
        mask = sliding_window_mask(t, WINDOW)
        rows["written out (window)"] = lambda q, k, v, s: sink_attention(
            q, k, v, s, mask.to(q.device)
        )
    return rows


def _timed(fn: Callable, leaves: list[torch.Tensor], dout: torch.Tensor, cuda: bool) -> float:
    for x in leaves:
        x.grad = None
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter() if cuda else time.process_time()
    fn(*leaves).backward(dout)
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() if cuda else time.process_time()) - start


def measure(t: int, heads: int, kv_heads: int, rounds: int, oracle_max: int) -> dict[str, float]:
    """Median ms per forward + backward of each row at sequence ``t``."""
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator().manual_seed(0)
    shapes = [(1, heads, t, HEAD_DIM), (1, kv_heads, t, HEAD_DIM), (1, kv_heads, t, HEAD_DIM)]
    leaves = [torch.randn(*s, generator=g).to(device, dtype).requires_grad_() for s in shapes]
    leaves.append(torch.randn(heads, generator=g).to(device, dtype).requires_grad_())
    dout = torch.randn(1, heads, t, HEAD_DIM, generator=g).to(device, dtype)
    rows = _rows(t, oracle_max)
    for fn in rows.values():  # warm-up
        _timed(fn, leaves, dout, cuda)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            times[name].append(_timed(fn, leaves, dout, cuda))
    return {name: 1000 * statistics.median(ts) for name, ts in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--oracle-max", type=int, default=2048)
    parser.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads (0: default)"
    )
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results = {t: measure(t, a.heads, a.kv_heads, a.rounds, a.oracle_max) for t in a.seqs}
    if a.json:
        print(json.dumps({"device": device, "results": results}))
        return 0
    print(f"device: {device}, threads {torch.get_num_threads()}, heads {a.heads}/{a.kv_heads}")
    print("| seq | kernel | ms fwd+bwd | x causal |\n| ---: | --- | ---: | ---: |")
    for t, rows in results.items():
        for name, ms in rows.items():
            print(f"| {t} | {name} | {ms:.1f} | {ms / rows['causal']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
