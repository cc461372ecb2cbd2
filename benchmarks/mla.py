"""Multi-head latent attention against grouped-query attention at equal parameters, and the price
of multi-token prediction per training step.

    python benchmarks/mla.py [--batch 4] [--seq 512] [--rounds 5] [--threads N] [--json]

**attention.** One attention layer, forward + backward (the gradient of a fixed random output
gradient), on ``[batch, seq, dim]`` inputs, dim 1024: MLA as DeepSeek-V3 shapes it scaled down
(16 heads, query/key 128 + 64 rotary, values 128, ``q_lora_rank`` 384, ``kv_lora_rank`` 128)
against grouped-query attention (``GroupedQueryAttention``, Llama's) with the head count, 4 kv
heads of width 64, chosen so that its parameters are as close as possible to MLA's (both counts
printed). Beside each: the attention's matmul FLOPs per token (the projections, and ``Q K^T`` +
``A V`` over the causal half) and the KV cache a token leaves for generation (MLA: the latent
and the rotary key; GQA: keys and values of its kv heads), in elements.

**mtp.** The ``deepseek_v3`` debug flavor's training step (forward, loss, backward) with its one
multi-token-prediction depth (the loss as training computes it, ``train/loss.py``'s ``MTPLoss``)
and without (``num_mtp_layers`` 0), on the same batch: ms per step and their ratio. The depth is
one more MoE block and one more pass through the output head.

On CPU the ms are the median over ``--rounds`` of the CPU time of the process per call
(``time.process_time``), the variants alternating within each round; on CUDA wall time around
``torch.cuda.synchronize``.
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan.models.common import rope  # noqa: E402
from torchtitan.models.common.blocks import GroupedQueryAttention  # noqa: E402
from torchtitan.models.common.mla import MultiLatentAttention  # noqa: E402

DIM = 1024


def _mla() -> tuple[nn.Module, torch.Tensor, dict]:
    shape = dict(heads=16, q_lora=384, kv_lora=128, nope=128, rope=64, v=128)
    module = MultiLatentAttention(DIM, 16, 384, 128, 128, 64, 128)
    table = rope.interleaved_table(rope.angles(rope.inv_freqs(64, 10000.0), 4096))
    return module, table, shape


def _gqa(target: int) -> tuple[nn.Module, torch.Tensor, dict]:
    """The head count (kv heads 4 of width 64) whose parameters are nearest ``target``."""
    best = None
    for heads in range(4, 65, 4):
        params = DIM * (heads + 8) * 64 + heads * 64 * DIM
        if best is None or abs(params - target) < abs(best[1] - target):
            best = (heads, params)
    heads = best[0]
    module = GroupedQueryAttention(DIM, heads, 4, 64, rope.apply_half_split)
    table = rope.half_split_table(rope.angles(rope.inv_freqs(64, 10000.0), 4096))
    return module, table, dict(heads=heads, kv_heads=4, head_dim=64)


def _flops_per_token(kind: str, shape: dict, params: int, seq: int) -> float:
    """Forward matmul FLOPs per token: 2 per projection parameter, and the causal half of
    ``Q K^T`` (query/key width) and ``A V`` (value width) over ``seq`` keys."""
    if kind == "mla":
        qk, v = shape["nope"] + shape["rope"], shape["v"]
    else:
        qk = v = shape["head_dim"]
    return 2 * params + 2 * shape["heads"] * (qk + v) * seq / 2


def _kv_cache_per_token(kind: str, shape: dict) -> int:
    if kind == "mla":
        return shape["kv_lora"] + shape["rope"]
    return 2 * shape["kv_heads"] * shape["head_dim"]


def _timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def _rounds(variants: dict, rounds: int, device: str) -> dict[str, float]:
    """Median ms per call of each variant, alternating which goes first."""
    for fn in variants.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(_timed(variants[name], device))
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def attention(batch: int, seq: int, rounds: int, device: str) -> list[dict]:
    torch.manual_seed(0)
    mla, mla_table, mla_shape = _mla()
    mla_params = sum(p.numel() for p in mla.parameters())
    gqa, gqa_table, gqa_shape = _gqa(mla_params)
    x = torch.randn(batch, seq, DIM, device=device)
    dout = torch.randn(batch, seq, DIM, device=device)
    rows = {}
    variants = {}
    for kind, module, table, shape in (
        ("mla", mla, mla_table, mla_shape),
        ("gqa", gqa, gqa_table, gqa_shape),
    ):
        module.to(device)
        table = table.to(device)
        params = sum(p.numel() for p in module.parameters())

        def step(module=module, table=table) -> None:
            module.zero_grad(set_to_none=True)
            module(x, table).backward(dout)

        variants[kind] = step
        rows[kind] = {
            "attention": kind,
            "shape": shape,
            "parameters": params,
            "gflops_per_token": _flops_per_token(kind, shape, params, seq) / 1e9,
            "kv_cache_per_token": _kv_cache_per_token(kind, shape),
        }
    for kind, ms in _rounds(variants, rounds, device).items():
        rows[kind]["ms"] = ms
    return list(rows.values())


def mtp(batch: int, seq: int, rounds: int, device: str) -> list[dict]:
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model
    from torchtitan.models.deepseek_v3.flavors import deepseek_v3_configs
    from torchtitan.train.loss import MTPLoss, cross_entropy_loss, mtp_targets, token_mean

    vocab = 2256  # the test tokenizer's
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    sum_ce = token_mean(lambda p, y: cross_entropy_loss(p, y, reduction="sum"))
    variants, rows = {}, {}
    for depths in (0, 1):
        args = dataclasses.replace(
            deepseek_v3_configs["debugmodel"], vocab_size=vocab, num_mtp_layers=depths
        )
        torch.manual_seed(0)
        model = DeepSeekV3Model(args).to(device)
        model.init_weights()
        if depths:
            model.mtp_active = True
            loss_fn, targets = MTPLoss(sum_ce, depths, 0.3, True), mtp_targets(labels, None, 1)
        else:
            loss_fn, targets = sum_ce, labels

        def step(model=model, loss_fn=loss_fn, targets=targets) -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(inputs), targets, float(labels.numel())).backward()

        variants[depths] = step
        rows[depths] = {
            "mtp_depths": depths,
            "parameters": sum(p.numel() for p in model.parameters()),
        }
    for depths, ms in _rounds(variants, rounds, device).items():
        rows[depths]["ms"] = ms
    rows[1]["vs_without"] = rows[1]["ms"] / rows[0]["ms"]
    return list(rows.values())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    result = {
        "attention": attention(a.batch, a.seq, a.rounds, a.device),
        "mtp": mtp(a.batch, a.seq, a.rounds, a.device),
    }
    if a.json:
        print(json.dumps(result))
        return
    print(f"attention, one layer, forward + backward, batch {a.batch} x seq {a.seq}, {a.device}")
    print(f"{'':5} {'shape':44} {'params':>10} {'GFLOP/token':>12} {'KV/token':>9} {'ms':>9}")
    for r in result["attention"]:
        shape = ",".join(f"{k} {v}" for k, v in r["shape"].items())
        print(
            f"{r['attention']:5} {shape:44} {r['parameters']:>10,} "
            f"{r['gflops_per_token']:>12.4f} {r['kv_cache_per_token']:>9,} {r['ms']:>9.1f}"
        )
    print(f"\nmtp: deepseek_v3 debugmodel training step, batch {a.batch} x seq {a.seq}, {a.device}")
    print(f"{'depths':>6} {'params':>12} {'ms':>9} {'vs none':>8}")
    for r in result["mtp"]:
        ratio = f"{r['vs_without']:.2f}x" if "vs_without" in r else ""
        print(f"{r['mtp_depths']:>6} {r['parameters']:>12,} {r['ms']:>9.1f} {ratio:>8}")


if __name__ == "__main__":
    main()
