"""Our Llama training step against the shortest hand-written model of the same math; peak memory.

    python benchmarks/model_step.py [--shapes debug,512] [--warmup 1] [--rounds 6] [--steps 1] \\
        [--time-chunks 8] [--loss-chunks 0,8] [--device cpu|cuda] [--no-memory] [--json]

Timing: for each shape, ``torchtitan.models.llama.model.Transformer`` ("ours", loss
``cross_entropy_loss``) and :class:`ReferenceModel` below ("ref": one fused QKV projection,
``F.rms_norm``, rotate-half rotary from cos/sin buffers, ``F.scaled_dot_product_attention`` with
the KV heads as they are, SwiGLU, untied output) are built with the same hyper-parameters (their
parameter counts are asserted equal), in float32, each with ``torch.optim.AdamW(lr=1e-4,
fused=True)`` (foreach when fused is refused; the output says which). One training step is
forward + cross entropy + backward + ``opt.step()`` + ``opt.zero_grad()``, on random token
batches made once beforehand (seed 0), the same for both. After ``--warmup`` steps of each,
``--rounds`` rounds of ``--steps`` steps of ours then the same of ref, alternating which goes
first each round. Every step is timed with ``time.process_time`` (CPU time of the process: the
primary number on CPU, less disturbed by other work on a shared machine) and
``time.perf_counter`` (wall; the only one on CUDA, with ``torch.cuda.synchronize`` around each
step). Reported per shape: the median ms per step of each, and the ratios: median over rounds of
(ours round time / ref round time). A ratio <= 1.00 means ours is no slower. With
``--time-chunks N`` (default 8; 0: off) a third model takes part in every round: ours with the
output projection and loss in N pieces (``training.loss_chunks``); its column is the median over
rounds of (its round time / ours whole): the time price of the memory saving below. The order of
the models rotates from round to round.

Memory: one training step of ours with ``--loss-chunks`` 0 (logits then loss) and N > 0
(``model.output_in_loss = True`` and ``ChunkedOutputLoss(model.output, N)`` from
``torchtitan.train.loss``: the logits made and dropped chunk by chunk). Each
configuration runs in a fresh process (``--_memory-worker``) so that memory one variant freed
and the allocator kept cannot hide the other's peak: a warm-up step (optimizer state allocated),
then the measured step. On CUDA: ``max_memory_allocated`` during the step minus
``memory_allocated`` before it. On CPU: the process's peak resident set during the step (VmHWM
after resetting it through ``/proc/self/clear_refs``) minus its resident set before it (after
``malloc_trim``, so heap pages freed by the warm-up step do not count as in use); the worker runs
with ``MALLOC_MMAP_THRESHOLD_=131072`` (unless set) so that glibc maps every tensor of 128 KiB and
more on its own and unmaps it when freed: with its default, growing threshold, activations of
tens of MiB land in the heap, whose freed pages stay resident and hide most of the saving.
Shown beside: the size of the float32 logits (batch x seq x vocab x 4 bytes) and the first step's
loss (the same with and without chunking, up to rounding).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torchtitan.models.llama.model import ModelArgs, Transformer  # noqa: E402
from torchtitan.observability.metrics import proc_status_kib  # noqa: E402
from torchtitan.train.loss import cross_entropy_loss  # noqa: E402

MIB = 1024**2
NO_CHUNKED_LOSS = "n/a (ChunkedOutputLoss not available)"


class Shape(NamedTuple):
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    seq: int
    batch: int

    def model_args(self) -> ModelArgs:
        return ModelArgs(
            dim=self.dim,
            n_layers=self.n_layers,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            vocab_size=self.vocab,
            max_seq_len=self.seq,
        )


SHAPES = {
    "debug": Shape(
        "debug", dim=256, n_layers=6, n_heads=16, n_kv_heads=8, vocab=2256, seq=256, batch=8
    ),
    "512": Shape(
        "512", dim=512, n_layers=8, n_heads=8, n_kv_heads=8, vocab=32000, seq=512, batch=4
    ),
}


# --------------------------------------------------------------------------------------------
# The reference: the same math, written as briefly as it goes
# --------------------------------------------------------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout: ``x [B, H, T, D]``, ``cos``/``sin`` ``[T, D]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class ReferenceBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int, eps: float) -> None:
        super().__init__()
        self.heads, self.head_dim, self.eps = (n_heads, n_kv_heads, n_kv_heads), dim // n_heads, eps
        self.attn_norm = nn.Parameter(torch.ones(dim))
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(dim))
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(F.rms_norm(x, (d,), self.attn_norm, self.eps))
        q, k, v = qkv.view(b, t, -1, self.head_dim).transpose(1, 2).split(self.heads, dim=1)
        a = F.scaled_dot_product_attention(
            rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True, enable_gqa=True
        )
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = F.rms_norm(x, (d,), self.mlp_norm, self.eps)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ReferenceModel(nn.Module):
    """Pre-norm decoder: embedding, blocks, final RMSNorm, untied output; float32 logits."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, head_dim, self.eps = args.dim, args.dim // args.n_heads, args.norm_eps
        self.embed = nn.Embedding(args.vocab_size, dim)
        self.blocks = nn.ModuleList(
            ReferenceBlock(dim, args.n_heads, args.n_kv_heads, args.ffn_hidden_dim(), self.eps)
            for _ in range(args.n_layers)
        )
        self.norm = nn.Parameter(torch.ones(dim))
        self.output = nn.Linear(dim, args.vocab_size, bias=False)
        freqs = args.rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(args.max_seq_len, dtype=torch.float64), freqs)
        self.register_buffer("cos", angles.cos().repeat(1, 2).float(), persistent=False)
        self.register_buffer("sin", angles.sin().repeat(1, 2).float(), persistent=False)
        for p in self.parameters():  # embedding N(0, 1), matrices N(0, 0.02), norms at one
            if p.dim() == 2 and p is not self.embed.weight:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h, self.cos[:t], self.sin[:t])
        return self.output(F.rms_norm(h, (h.shape[-1],), self.norm, self.eps)).float()


def reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


# --------------------------------------------------------------------------------------------
# Building and stepping
# --------------------------------------------------------------------------------------------

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Trainee(NamedTuple):
    model: nn.Module
    opt: torch.optim.Optimizer
    loss_fn: LossFn
    optimizer_impl: str


def adamw(model: nn.Module) -> tuple[torch.optim.Optimizer, str]:
    """``AdamW(lr=1e-4, fused=True)``; the foreach implementation if fused is refused."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True), "fused"
    except (RuntimeError, ValueError) as e:
        print(f"note: AdamW fused=True refused ({e}); using foreach", file=sys.stderr)
        return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True), "foreach"


def make_trainee(model: nn.Module, loss_fn: LossFn) -> Trainee:
    opt, impl = adamw(model)
    return Trainee(model, opt, loss_fn, impl)


def build_ours(shape: Shape, device: str, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(shape.model_args())
    model.init_weights()
    return model.to(device)


def build_reference(shape: Shape, device: str, seed: int = 0) -> ReferenceModel:
    torch.manual_seed(seed)
    return ReferenceModel(shape.model_args()).to(device)


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_pair(shape: Shape, device: str, time_chunks: int = 0) -> dict[str, Trainee]:
    """Ours and the reference with their optimizers; their parameter counts must be equal.
    With ``time_chunks`` > 0 also ours with the loss in that many pieces ("chunked")."""
    ours, ref = build_ours(shape, device), build_reference(shape, device)
    assert n_params(ours) == n_params(ref), (shape, n_params(ours), n_params(ref))
    trainees = {
        "ours": make_trainee(ours, cross_entropy_loss),
        "ref": make_trainee(ref, reference_loss),
    }
    if time_chunks > 0:
        trainees["chunked"] = build_memory_trainee(shape, device, time_chunks)
    return trainees


def make_batches(shape: Shape, n: int, device: str, seed: int = 0) -> torch.Tensor:
    """``[n, batch, seq + 1]`` random tokens: inputs ``[..., :-1]``, labels ``[..., 1:]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, shape.vocab, (n, shape.batch, shape.seq + 1), generator=g).to(device)


def train_step(t: Trainee, batch: torch.Tensor) -> torch.Tensor:
    loss = t.loss_fn(t.model(batch[:, :-1]), batch[:, 1:])
    loss.backward()
    t.opt.step()
    t.opt.zero_grad(set_to_none=True)
    return loss


def timed_steps(t: Trainee, batches: torch.Tensor, device: str) -> list[tuple[float, float]]:
    """(CPU seconds, wall seconds) of one step per batch."""
    cuda = device.startswith("cuda")
    times = []
    for batch in batches:
        if cuda:
            torch.cuda.synchronize()
        cpu, wall = time.process_time(), time.perf_counter()
        train_step(t, batch)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.process_time() - cpu, time.perf_counter() - wall))
    return times


# --------------------------------------------------------------------------------------------
# Timing: paired rounds
# --------------------------------------------------------------------------------------------


def time_shape(
    shape: Shape, device: str, warmup: int, rounds: int, steps: int, time_chunks: int = 0
) -> dict:
    """One row: median ms per step of ours and ref, and the median per-round time ratios (with
    ``time_chunks``, also ours with the loss in pieces against ours whole)."""
    pair = build_pair(shape, device, time_chunks)
    batches = make_batches(shape, steps, device)
    for t in pair.values():
        for i in range(warmup):
            train_step(t, batches[i % steps])
    names = list(pair)
    per_round: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate who goes first
            per_round[name].append(timed_steps(pair[name], batches, device))
        ours_s, ref_s = (sum(w for _, w in per_round[n][-1]) for n in ("ours", "ref"))
        print(
            f"{shape.name} round {r + 1}/{rounds}: wall ours {ours_s:.3f}s  ref {ref_s:.3f}s",
            file=sys.stderr,
        )
    return _summarize(shape, pair, per_round, on_cpu=not device.startswith("cuda"))


def _summarize(shape: Shape, pair: dict[str, Trainee], per_round: dict, on_cpu: bool) -> dict:
    def median_ms(name: str, i: int) -> float:
        return 1e3 * statistics.median(s[i] for rnd in per_round[name] for s in rnd)

    def ratio(i: int, top: str = "ours", bottom: str = "ref") -> float:
        return statistics.median(
            sum(s[i] for s in a) / sum(s[i] for s in b)
            for a, b in zip(per_round[top], per_round[bottom])
        )

    chunked = "chunked" in per_round
    return {
        "shape": shape.name,
        "params": n_params(pair["ours"].model),
        "optimizer": pair["ours"].optimizer_impl,
        "rounds": len(per_round["ours"]),
        "steps_per_round": len(per_round["ours"][0]),
        "ours_cpu_ms": median_ms("ours", 0) if on_cpu else None,
        "ref_cpu_ms": median_ms("ref", 0) if on_cpu else None,
        "ratio_cpu": ratio(0) if on_cpu else None,
        "ours_wall_ms": median_ms("ours", 1),
        "ref_wall_ms": median_ms("ref", 1),
        "ratio_wall": ratio(1),
        "chunks_ratio_cpu": ratio(0, "chunked", "ours") if chunked and on_cpu else None,
        "chunks_ratio_wall": ratio(1, "chunked", "ours") if chunked else None,
    }


def time_shapes(
    shapes: list[Shape], device: str, warmup: int, rounds: int, steps: int, time_chunks: int = 0
) -> list:
    return [time_shape(s, device, warmup, rounds, steps, time_chunks) for s in shapes]


# --------------------------------------------------------------------------------------------
# Memory: one step of ours, each configuration in its own process
# --------------------------------------------------------------------------------------------


def chunked_loss_available() -> bool:
    try:
        from torchtitan.train.loss import ChunkedOutputLoss  # noqa: F401
    except ImportError:
        return False
    return True


def logits_mib(shape: Shape) -> float:
    return shape.batch * shape.seq * shape.vocab * 4 / MIB


def build_memory_trainee(shape: Shape, device: str, n_chunks: int) -> Trainee:
    model = build_ours(shape, device)
    loss_fn: LossFn = cross_entropy_loss
    if n_chunks > 0:
        from torchtitan.train.loss import ChunkedOutputLoss

        model.output_in_loss = True  # forward returns the final norm's output [B, T, dim]
        loss_fn = ChunkedOutputLoss(model.output, n_chunks)
    return make_trainee(model, loss_fn)


def _trim_heap() -> None:
    """Give free heap pages back to the OS (glibc), so the resident set is what is in use."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_worker(shape: Shape, device: str, n_chunks: int) -> dict:
    """Warm-up step, then the measured step's peak above the memory in use before it."""
    t = build_memory_trainee(shape, device, n_chunks)
    batches = make_batches(shape, 2, device)
    first_loss = train_step(t, batches[0]).item()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        train_step(t, batches[1]).item()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        _trim_heap()
        before = proc_status_kib("VmRSS") * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        train_step(t, batches[1]).item()
        peak = proc_status_kib("VmHWM") * 1024 - before
    return {
        "shape": shape.name,
        "loss_chunks": n_chunks,
        "peak_mib": peak / MIB,
        "before_mib": before / MIB,
        "logits_mib": logits_mib(shape),
        "first_loss": first_loss,
        "optimizer": t.optimizer_impl,
    }


def measure_memory(shape: Shape, device: str, n_chunks: int, have_chunked: bool) -> dict:
    row = {"shape": shape.name, "loss_chunks": n_chunks, "logits_mib": logits_mib(shape)}
    if n_chunks > 0 and not have_chunked:
        return {**row, "error": NO_CHUNKED_LOSS}
    worker = ["--_memory-worker", f"{shape.name}:{n_chunks}", "--device", device]
    cmd = [sys.executable, str(Path(__file__).resolve()), *worker]
    # glibc: every block from 128 KiB up mmap-ed, and unmapped when freed (a fixed threshold, not
    # the default one that grows to 32 MiB), so the resident set follows the tensors alive.
    env = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024), **os.environ}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**row, "error": f"worker failed (rc {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------
# Output and CLI
# --------------------------------------------------------------------------------------------


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_timing(rows: list[dict], time_chunks: int = 0) -> str:
    chunks = f"{'chunks ' + str(time_chunks) + ' / ours':>17}" if time_chunks else ""
    lines = [
        f"{'shape':<6} {'params':>11} {'ours ms':>9} {'ref ms':>9} {'ratio (cpu)':>12} "
        f"{'ratio (wall)':>13} {'ours wall ms':>13} {'ref wall ms':>12}" + chunks
    ]
    for r in rows:
        cost = (
            r["chunks_ratio_cpu"] if r["chunks_ratio_cpu"] is not None else r["chunks_ratio_wall"]
        )
        lines.append(
            f"{r['shape']:<6} {r['params']:>11,} {_num(r['ours_cpu_ms'], '.1f'):>9} "
            f"{_num(r['ref_cpu_ms'], '.1f'):>9} {_num(r['ratio_cpu'], '.3f'):>12} "
            f"{r['ratio_wall']:>13.3f} {r['ours_wall_ms']:>13.1f} {r['ref_wall_ms']:>12.1f}"
            + (f"{_num(cost, '.3f'):>17}" if time_chunks else "")
        )
    return "\n".join(lines)


def format_memory(rows: list[dict], device: str) -> str:
    what = "max_memory_allocated" if device.startswith("cuda") else "VmHWM"
    lines = [
        f"{'shape':<6} {'loss chunks':>11} {'step peak MiB':>14} {'before MiB':>11} "
        f"{'logits MiB':>11} {'loss (step 1)':>14}"
    ]
    for r in rows:
        head = f"{r['shape']:<6} {r['loss_chunks'] or 'off':>11} "
        if "error" in r:
            lines.append(head + f"{r['error']}   (logits {r['logits_mib']:.1f} MiB)")
            continue
        lines.append(
            head + f"{r['peak_mib']:>14.1f} {r['before_mib']:>11.1f} "
            f"{r['logits_mib']:>11.1f} {r['first_loss']:>14.4f}"
        )
    lines.append(f"(step peak: {what} during one step minus the memory in use before it)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="debug,512", help=f"commas: {', '.join(SHAPES)}")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps of each model")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=1, help="steps of each model per round")
    parser.add_argument("--loss-chunks", default="0,8", help="commas; 0 = no chunking")
    parser.add_argument(
        "--time-chunks",
        type=int,
        default=8,
        help="also time ours with the loss in this many pieces, against ours whole (0: no)",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--no-memory", action="store_true", help="skip the memory table")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--_memory-worker", dest="memory_worker", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    try:
        a.shapes = [SHAPES[s.strip()] for s in a.shapes.split(",") if s.strip()]
        a.loss_chunks = [int(c) for c in a.loss_chunks.split(",") if c.strip()]
    except (KeyError, ValueError) as e:
        parser.error(f"--shapes / --loss-chunks: cannot parse ({e})")
    if min(a.warmup, a.rounds - 1, a.steps - 1) < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.memory_worker:
        name, chunks = a.memory_worker.split(":")
        print(json.dumps(memory_worker(SHAPES[name], a.device, int(chunks))))
        return 0
    start = time.perf_counter()
    timing = time_shapes(a.shapes, a.device, a.warmup, a.rounds, a.steps, a.time_chunks)
    memory = []
    if not a.no_memory:
        have = chunked_loss_available()
        memory = [measure_memory(s, a.device, c, have) for s in a.shapes for c in a.loss_chunks]
    result = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup": a.warmup,
        "rounds": a.rounds,
        "steps": a.steps,
        "timing": timing,
        "memory": memory,
        "seconds": time.perf_counter() - start,
    }
    if a.json:
        print(json.dumps(result))
        return 0
    opt = ", ".join(sorted({r["optimizer"] for r in timing}))
    opt += " (fused=True was refused)" if "foreach" in opt else ""
    print(
        f"device: {result['device']}  torch {result['torch']}  threads {result['threads']}  "
        f"AdamW {opt}  float32\n"
        f"training step, {a.rounds} rounds x {a.steps} steps after {a.warmup} warm-up steps; "
        "ms = median per step (CPU time of the process on CPU), ratio = median over rounds "
        "of ours / ref (<= 1.00: ours no slower)"
    )
    print(format_timing(timing, a.time_chunks))
    if memory:
        print(f"\npeak memory of one training step of ours ({a.device})")
        print(format_memory(memory, a.device))
    print(f"\n({result['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
