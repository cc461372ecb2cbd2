"""Hybrid linear attention against softmax attention: tokens per second of one training step
(forward + backward) of the same small Qwen3-Next model with every layer softmax, with three
Gated DeltaNet layers for each softmax one (the published ratio), and with every layer linear,
at sequence 2048, 8192 and 32768; and the activations each keeps for backward, per token.

    python benchmarks/hybrid_attention.py [--seqs 2048 8192 32768] [--layers 4] [--rounds 1]
                                          [--device cpu|cuda] [--threads N] [--json]

The model is the ``qwen3_next`` debug flavor (dim 256, 4 layers, 4 query heads of 64 over 2 kv
heads, DeltaNet 2 key / 4 value heads of 32, 8 experts top-2 and a shared expert) with
``layer_types`` set per row; batch 1, float32. ``tok/s`` is the sequence length over the wall
time of the step (after one warm-up step at 256 tokens per row); ``KiB/token`` is what autograd
saved for backward (``saved_tensors_hooks``), over the sequence length. ``x softmax`` is the
row's tokens per second over the all-softmax row's at the same length: above 1, the hybrid
model is the faster one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan.models.qwen3_next.flavors import qwen3_next_configs  # noqa: E402
from torchtitan.models.qwen3_next.model import Qwen3NextModel  # noqa: E402

VOCAB = 2256


def _layer_types(kind: str, n_layers: int) -> tuple[str, ...]:
    if kind == "softmax":
        return ("full_attention",) * n_layers
    if kind == "linear":
        return ("linear_attention",) * n_layers
    return tuple(
        "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n_layers)
    )


ROWS = {"softmax": "all softmax", "hybrid": "3 linear : 1 softmax", "linear": "all linear"}


def _model(kind: str, n_layers: int, max_seq: int, device: str) -> Qwen3NextModel:
    args = dataclasses.replace(
        qwen3_next_configs["debugmodel"],
        n_layers=n_layers,
        vocab_size=VOCAB,
        max_seq_len=max_seq,
        layer_types=_layer_types(kind, n_layers),
    )
    torch.manual_seed(0)
    model = Qwen3NextModel(args)
    model.init_weights()
    return model.to(device)


def _step(model: Qwen3NextModel, t: int) -> tuple[float, int]:
    """(wall seconds, bytes saved for backward) of one forward + backward over ``t`` tokens."""
    tokens = torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(t))
    tokens = tokens.to(model.rope_cache.device)
    cuda = tokens.is_cuda
    saved = 0

    def pack(x: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += x.numel() * x.element_size()
        return x

    model.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, saved


def measure(t: int, n_layers: int, rounds: int, device: str = "cpu") -> dict[str, dict[str, float]]:
    """Each row's tokens per second (median over ``rounds``) and saved KiB per token."""
    out = {}
    for kind in ROWS:
        model = _model(kind, n_layers, max(t, 256), device)
        _step(model, min(t, 256))  # warm-up
        steps = [_step(model, t) for _ in range(rounds)]
        seconds = statistics.median(s for s, _ in steps)
        out[kind] = {"tok_per_s": t / seconds, "kib_per_token": steps[0][1] / t / 1024}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    results = {t: measure(t, a.layers, a.rounds, a.device) for t in a.seqs}
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    if a.json:
        print(json.dumps({"device": device, "results": results}))
        return 0
    print(
        f"device: {device}, threads {torch.get_num_threads()}, {a.layers} layers, batch 1, float32"
    )
    print("| seq | layers | tok/s | x softmax | KiB/token saved |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for t, rows in results.items():
        base = rows["softmax"]["tok_per_s"]
        for kind, r in rows.items():
            print(
                f"| {t} | {ROWS[kind]} | {r['tok_per_s']:.0f} | {r['tok_per_s'] / base:.2f} "
                f"| {r['kib_per_token']:.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
