"""Mixture of experts: the grouped-mm kernel against the per-expert loop, the expert-parallel
all-to-all volume computed from the config and observed in a real run, tokens/s per layout.

    python benchmarks/moe.py kernels [--sizes llama4-debug,qwen3-debug,many,big] [--warmup 1]
        [--rounds 5] [--steps 2] [--threads N] [--device cpu|cuda] [--dtype float32|bfloat16]
        [--json]
    python benchmarks/moe.py volume [--config train_configs/llama4_debug.toml] [--ngpu 2]
        [--steps 3] [--check-losses] [--keep DIR] [--json] [-- train.py overrides]
    python benchmarks/moe.py layouts [--config train_configs/llama4_debug.toml] [--steps 12]
        [--warmup 4] [--global-batch 8] [--json] [-- train.py overrides for every layout]

**kernels.** One :class:`GroupedExperts` per size (weights as ``init_weights(0.02)``), its rows
routed uniformly at random (each token to ``top_k`` distinct experts, seed 0) and sorted by
expert, as the MoE layer hands them over. One call is forward plus backward (the gradient of a
fixed random output gradient with respect to the rows and the three weights). The same module
runs both kernels (``grouped_mm`` on: ``torch._grouped_mm`` through the ``torchtitan::grouped_mm``
op; off: ``_swiglu_loop``, one expert after another), so the weights are the same; the outputs
and gradients of the two are compared (largest absolute difference). After ``--warmup`` calls
of each, ``--rounds`` rounds of ``--steps`` calls of each, alternating which goes first. On CPU
the ms are the median over rounds of the CPU time of the process per call
(``time.process_time``, less disturbed by other work on a shared machine; with ``--threads 1``
no idle thread spins into it), on CUDA wall time with ``torch.cuda.synchronize``; speedup is the
median over rounds of loop time / grouped time (CPU time, and wall time beside it).

**volume.** The all-to-all bytes each rank sends per training step under expert parallelism,
computed from the config, then observed in a real run: ``--ngpu`` worker processes (gloo on
CPU) each run ``train.py``'s ``main`` with the config, after this script has wrapped, in their
process only, the two module globals ``torchtitan/distributed/expert_parallel.py`` calls its
collectives through (``funcol`` and ``dist``) and the class's ``_dispatch``/``_combine`` (to
name the phase). The wrappers count the rows and bytes handed to each all-to-all, per peer,
and, through an identity autograd function on the result, those its backward sends; they change
no value, so training is the same (``--check-losses`` runs the same job once more without them
and compares every step's loss). Computed, per rank and step, with ``T`` tokens per rank per
micro-batch (local batch x seq_len / cp), ``k`` = top_k, ``d`` = dim, ``b`` bytes per element
(the parameter dtype: float32 on CPU), ``L`` MoE layers and ``m`` micro-batches (gradient
accumulation). Under tensor parallel every TP rank routes the whole sequence (``T`` as above): with
the experts split over TP each sends all ``T k`` rows, with whole experts
(``expert_tensor_parallel_degree`` 1) only its ``1/tp`` share, and every ``T k`` below is divided
by ``tp``:

* dispatch, forward: ``m L T k`` rows of ``d b`` bytes: exact on every rank (each token's
  ``k`` copies go out, wherever their experts are);
* combine, forward: the rows this rank's experts received, sent back: ``m L T k`` under
  balanced routing, data-dependent per rank, exact summed over the ranks;
* combine, backward: the gradients of this rank's ``m L T k`` output rows: exact per rank;
* dispatch, backward: the gradients of the rows its experts received: as combine forward;
* counts: one all-to-all of ``E`` int64 per layer and micro-batch, forward only (exact).

Under balanced routing ``1/ep`` of the rows stay on the rank (its own experts), ``(ep-1)/ep``
leave it; with whole experts, whose TP ranks send contiguous runs of experts, see
:func:`leaves_fraction` (nothing leaves when ``ep = tp``). With ``activation_checkpoint.mode full`` the forward all-to-alls run twice (the
recomputation). Pipeline parallelism is not modeled (refused). The check: on every
rank the exact phases' observed rows equal the computed ones, and summed over the ranks every
phase's rows do (routing moves rows between ranks; it does not change how many are sent).

**layouts.** Tokens/s of the MoE config in four layouts through ``benchmarks/train_throughput.py``
(one ``./run_llama_train.sh`` run each, ``--ngpu`` per setting): one process, FSDP over 2,
EP 2 (its 2 ranks also FSDP the other weights), EP 2 x FSDP 2 over 4 processes (the experts
FSDP-sharded over 2, the rest over 4). The global batch is the same in all (``--global-batch``
sequences: local batch = global / processes), so the losses should agree and the loss-gap
column checks the layouts against one process; total tokens/s is per device x processes. On a
machine with few cores ``OMP_NUM_THREADS=1`` keeps the processes from oversubscribing them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torchtitan.models.common.moe import GroupedExperts  # noqa: E402

MIB = 1024**2

# --------------------------------------------------------------------------------------------
# kernels: grouped-mm against the per-expert loop
# --------------------------------------------------------------------------------------------


class KernelSize(NamedTuple):
    name: str
    tokens: int
    experts: int
    top_k: int
    dim: int
    hidden: int

    @property
    def rows(self) -> int:
        return self.tokens * self.top_k

    @property
    def flops(self) -> int:
        """Forward + backward of the three matmuls: 3 x 2 x rows x dim x hidden, times 3."""
        return 18 * self.rows * self.dim * self.hidden


KERNEL_SIZES = {
    s.name: s
    for s in (
        KernelSize("tiny", tokens=64, experts=4, top_k=2, dim=32, hidden=64),
        # the debug flavors' MoE layers on one local batch (8 x 256 tokens)
        KernelSize("llama4-debug", tokens=2048, experts=8, top_k=1, dim=256, hidden=256),
        KernelSize("qwen3-debug", tokens=2048, experts=8, top_k=2, dim=256, hidden=256),
        # many small experts: where one kernel call per expert costs the most
        KernelSize("many", tokens=2048, experts=64, top_k=4, dim=256, hidden=128),
        KernelSize("big", tokens=4096, experts=16, top_k=2, dim=512, hidden=1024),
        # one layer of the published sizes on 8192 tokens, for a GPU (minutes per call on CPU)
        KernelSize("scout", tokens=8192, experts=16, top_k=1, dim=5120, hidden=8192),
        KernelSize("qwen3-30b", tokens=8192, experts=128, top_k=8, dim=2048, hidden=768),
    )
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class KernelCase(NamedTuple):
    experts: GroupedExperts
    x: torch.Tensor
    counts: torch.Tensor
    grad: torch.Tensor


def make_case(size: KernelSize, device: str, dtype: torch.dtype) -> KernelCase:
    """The experts, their rows sorted by expert with ``counts``, an output gradient (seed 0)."""
    torch.manual_seed(0)
    with torch.device(device):
        experts = GroupedExperts(size.dim, size.hidden, size.experts, grouped_mm=True)
    experts.init_weights(0.02)
    experts.to(dtype=dtype)
    choice = torch.rand(size.tokens, size.experts).topk(size.top_k, dim=-1).indices.flatten()
    counts = torch.bincount(choice, minlength=size.experts)
    x = torch.randn(size.rows, size.dim).to(device=device, dtype=dtype)
    grad = torch.randn(size.rows, size.dim).to(device=device, dtype=dtype)
    return KernelCase(experts, x, counts.to(device), grad)


def run_kernel(case: KernelCase, grouped: bool) -> list[torch.Tensor]:
    """One forward + backward; the output and the gradients of the rows, w1, w2, w3."""
    case.experts.grouped_mm = grouped
    case.experts.zero_grad(set_to_none=True)
    x = case.x.detach().requires_grad_()
    out = case.experts(x, case.counts)
    out.backward(case.grad)
    e = case.experts
    return [out.detach(), x.grad, e.w1.grad, e.w2.grad, e.w3.grad]


def _timed(fn: Callable[[], Any], cuda: bool) -> tuple[float, float]:
    """(CPU seconds of the process, wall seconds) of one call."""
    if cuda:
        torch.cuda.synchronize()
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize()
    return time.process_time() - cpu, time.perf_counter() - wall


def time_kernels(size: KernelSize, device: str, dtype: torch.dtype, a: argparse.Namespace) -> dict:
    case = make_case(size, device, dtype)
    cuda = device.startswith("cuda")
    got = {g: run_kernel(case, g) for g in (True, False)}
    diff_out = (got[True][0].float() - got[False][0].float()).abs().max().item()
    diff_grad = max(
        (g.float() - w.float()).abs().max().item() for g, w in zip(got[True][1:], got[False][1:])
    )
    for _ in range(a.warmup):
        for g in (True, False):
            run_kernel(case, g)
    times: dict[bool, list[list[tuple[float, float]]]] = {True: [], False: []}
    for r in range(a.rounds):
        for g in (True, False) if r % 2 == 0 else (False, True):
            call = functools.partial(run_kernel, case, g)
            times[g].append([_timed(call, cuda) for _ in range(a.steps)])
    return _kernel_row(size, times, cuda, diff_out, diff_grad, got[False][0])


def _kernel_row(
    size: KernelSize, times: dict, cuda: bool, diff_out: float, diff_grad: float, ref: torch.Tensor
) -> dict:
    clock = 1 if cuda else 0  # the primary clock: CPU time on CPU, wall on CUDA

    def median_ms(g: bool, i: int) -> float:  # of the rounds' mean time per call
        return 1e3 * statistics.median(sum(t[i] for t in rnd) / len(rnd) for rnd in times[g])

    def speedup(i: int) -> float:
        return statistics.median(
            sum(t[i] for t in loop) / sum(t[i] for t in grouped)
            for grouped, loop in zip(times[True], times[False])
        )

    grouped_ms = median_ms(True, clock)
    return {
        "size": size.name,
        **size._asdict(),
        "rows": size.rows,
        "grouped_ms": grouped_ms,
        "loop_ms": median_ms(False, clock),
        "speedup": speedup(clock),
        "speedup_wall": speedup(1),
        "grouped_gflops": size.flops / grouped_ms / 1e6,
        "max_abs_diff_out": diff_out,
        "max_abs_diff_grad": diff_grad,
        "max_abs_out": ref.float().abs().max().item(),
    }


def format_kernels(rows: list[dict], clock: str) -> str:
    lines = [
        f"{'size':<13} {'tokens':>6} {'E':>3} {'k':>2} {'dim':>5} {'hidden':>6} "
        f"{'grouped ms':>10} {'loop ms':>9} {'speedup':>8} {'(wall)':>7} {'GFLOP/s':>8} "
        f"{'max|diff| out':>14} {'grads':>9}"
    ]
    for r in rows:
        lines.append(
            f"{r['size']:<13} {r['tokens']:>6} {r['experts']:>3} {r['top_k']:>2} {r['dim']:>5} "
            f"{r['hidden']:>6} {r['grouped_ms']:>10.2f} {r['loop_ms']:>9.2f} "
            f"{r['speedup']:>7.2f}x {r['speedup_wall']:>6.2f}x {r['grouped_gflops']:>8.1f} "
            f"{r['max_abs_diff_out']:>14.2e} {r['max_abs_diff_grad']:>9.2e}"
        )
    lines.append(
        f"ms: {clock} per forward+backward call, median over rounds; speedup: loop / grouped, "
        "median over rounds; GFLOP/s: the grouped kernel's; max|diff|: grouped against loop, "
        "output and gradients (rows, w1, w2, w3)"
    )
    return "\n".join(lines)


def cmd_kernels(a: argparse.Namespace) -> int:
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here")
    try:
        sizes = [KERNEL_SIZES[s.strip()] for s in a.sizes.split(",") if s.strip()]
    except KeyError as e:
        raise SystemExit(f"--sizes: unknown size {e}; known: {', '.join(KERNEL_SIZES)}") from None
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]
    rows = [time_kernels(s, a.device, dtype, a) for s in sizes]
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    if a.json:
        print(json.dumps({"device": device, "dtype": a.dtype, "rows": rows}))
        return 0
    print(
        f"GroupedExperts forward+backward, grouped-mm against the per-expert loop: {device}, "
        f"{a.dtype}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"{a.rounds} rounds x {a.steps} calls after {a.warmup} warm-up"
    )
    print(format_kernels(rows, "wall time" if a.device == "cuda" else "CPU time of the process"))
    return 0


# --------------------------------------------------------------------------------------------
# volume: computed from the config
# --------------------------------------------------------------------------------------------

PHASES = (
    "dispatch forward",
    "combine forward",
    "combine backward",
    "dispatch backward",
    "counts forward",
)
# the phases whose rows per rank do not depend on the routing
EXACT_PER_RANK = ("dispatch forward", "combine backward", "counts forward")


def leaves_fraction(dims: Any) -> float:
    """The share of a rank's dispatched rows that go to other ranks under balanced routing:
    ``(ep - 1) / ep``, each expert's rows spread evenly. With whole experts under TP a rank sends
    the rows of one contiguous run of experts, ``[r/tp, (r+1)/tp)`` of them for TP rank ``r``,
    and keeps those of its own ``[i/ep, (i+1)/ep)`` (``i``: its place in its EP group, the
    borrowed ranks being TP-innermost): the mean over the borrowed ranks of what leaves. With
    ``ep = tp`` the two runs coincide and nothing leaves."""
    if not dims.experts_whole_under_tp:
        return (dims.ep - 1) / dims.ep
    tp, ep, borrowed = dims.tp, dims.ep, dims.expert_borrowed_ranks
    stays = Fraction(0)
    for b in range(borrowed):
        r, i = b % tp, b % ep
        lo, hi = (
            max(Fraction(r, tp), Fraction(i, ep)),
            min(Fraction(r + 1, tp), Fraction(i + 1, ep)),
        )
        stays += max(hi - lo, Fraction(0)) * tp  # of the rank's share, 1/tp of the rows
    return float(1 - stays / borrowed)


def computed_volume(job_config: Any, world_size: int) -> dict:
    """Each phase's rows and bytes sent per rank and step, and the share that leaves the rank,
    under balanced routing (see the module doc)."""
    from torchtitan.distributed.data_parallel import param_dtype
    from torchtitan.distributed.utils import device_type
    from torchtitan.errors import TorchTitanError
    from torchtitan.train.plan import plan_job

    try:
        plan = plan_job(job_config, world_size)
    except TorchTitanError as e:
        raise SystemExit(f"volume: {e}") from None
    dims, args, t = plan.dims, plan.model_args, job_config.training
    moe = getattr(args, "moe", None)
    if moe is None:
        raise SystemExit(f"volume: model {job_config.model.name} has no MoE layers")
    if dims.pp > 1:
        raise SystemExit("volume: pipeline parallelism is not modeled here")
    ac = job_config.activation_checkpoint.mode
    if ac not in ("none", "full"):
        raise SystemExit(f"volume: activation_checkpoint.mode {ac} is not modeled (none, full)")
    forward_passes = 2 if ac == "full" else 1
    n_moe = sum(moe.is_moe_layer(i) for i in range(args.n_layers))
    tokens = t.local_batch_size * t.seq_len // dims.cp
    # under TP every rank routes the whole sequence; with whole experts each sends 1/tp of it
    share = dims.tp if dims.experts_whole_under_tp else 1
    micro = plan.grad_accum_steps
    elem = torch.empty((), dtype=param_dtype(job_config.training, device_type)).element_size()
    row_bytes = args.dim * elem
    phases = {}
    for phase in PHASES:
        passes = forward_passes if phase.endswith("forward") else 1
        calls = micro * n_moe * passes
        if phase.startswith("counts"):
            rows, nbytes = calls * moe.num_experts, calls * moe.num_experts * 8
        else:
            rows = calls * tokens * moe.top_k // share
            nbytes = rows * row_bytes
        phases[phase] = {"calls": calls, "rows": rows, "bytes": nbytes}
    return {
        "model": f"{job_config.model.name} {job_config.model.flavor}",
        "ep": dims.ep,
        "world_size": world_size,
        "tokens_per_rank_per_micro_batch": tokens,
        "top_k": moe.top_k,
        "tp_share": share,
        "num_experts": moe.num_experts,
        "dim": args.dim,
        "bytes_per_element": elem,
        "moe_layers": n_moe,
        "micro_batches": micro,
        "forward_passes": forward_passes,
        "leaves_fraction": leaves_fraction(dims),
        "phases": phases,
        "layout": dims.layout(),
    }


# --------------------------------------------------------------------------------------------
# volume: observed in worker processes
# --------------------------------------------------------------------------------------------


class Traffic:
    """Rows and bytes sent per phase, to this rank itself and to the other ranks."""

    def __init__(self) -> None:
        self.phase = "dispatch"
        self.sent: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, phase: str, splits: list[int], me: int, row_bytes: int) -> None:
        s = self.sent[phase]
        s["calls"] += 1
        s["rows"] += sum(splits)
        s["bytes"] += sum(splits) * row_bytes
        s["rows_self"] += splits[me]
        s["bytes_self"] += splits[me] * row_bytes


class _OnBackward(torch.autograd.Function):
    """Identity; calls ``hook(grad)`` when the gradient passes on its way back."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.hook = hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.hook(grad)
        return grad, None


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size() if t.dim() > 1 else t.element_size()


class _CountingFuncol:
    """``funcol`` as ``expert_parallel.py`` sees it: its row all-to-all counted, forward and
    backward; everything else passed through."""

    def __init__(self, funcol: Any, traffic: Traffic) -> None:
        self._funcol, self._traffic = funcol, traffic

    def __getattr__(self, name: str) -> Any:
        return getattr(self._funcol, name)

    def all_to_all_single_autograd(self, x, output_split_sizes, input_split_sizes, group):
        import torch.distributed as dist

        traffic, phase, me = self._traffic, self._traffic.phase, dist.get_rank(group)
        traffic.add(f"{phase} forward", list(input_split_sizes), me, _row_bytes(x))
        out = self._funcol.all_to_all_single_autograd(
            x, output_split_sizes, input_split_sizes, group
        )
        out = self._funcol.wait_tensor(out)
        back = list(output_split_sizes)  # the backward sends the output's gradient this way

        def hook(grad: torch.Tensor) -> None:
            traffic.add(f"{phase} backward", back, me, _row_bytes(grad))

        return _OnBackward.apply(out, hook) if out.requires_grad else out


class _CountingDist:
    """``torch.distributed`` as ``expert_parallel.py`` sees it: the counts all-to-all counted."""

    def __init__(self, dist: Any, traffic: Traffic) -> None:
        self._dist, self._traffic = dist, traffic

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dist, name)

    def all_to_all_single(
        self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw
    ):
        n = self._dist.get_world_size(group)
        sent = input_split_sizes or [input.numel() // n] * n  # counts: E / ep to each rank
        self._traffic.add("counts forward", list(sent), self._dist.get_rank(group), 8)
        return self._dist.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, group=group, **kw
        )


def install_counters() -> Traffic:
    """Count what ``expert_parallel.py`` sends, in this process (call before the model is
    built: ``ExpertParallel`` binds its dispatch and combine when it is applied)."""
    from torchtitan.distributed import expert_parallel as ep

    traffic = Traffic()
    ep.funcol = _CountingFuncol(ep.funcol, traffic)
    ep.dist = _CountingDist(ep.dist, traffic)
    for phase in ("dispatch", "combine"):
        original = getattr(ep.ExpertParallel, f"_{phase}")

        def named(self, *args, _original=original, _phase=phase):
            traffic.phase = _phase
            return _original(self, *args)

        setattr(ep.ExpertParallel, f"_{phase}", named)
    return traffic


def volume_worker(out_dir: str, train_args: list[str], count: bool) -> int:
    """One rank: ``train.py``'s main (counting the all-to-alls unless ``count`` is off), then
    its counts to ``out_dir/rank{RANK}.json``."""
    traffic = install_counters() if count else Traffic()
    import train

    rc = train.main(train_args)
    rank = int(os.environ.get("RANK", "0"))
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **traffic.sent}))
    return rc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_workers(n: int, out_dir: Path, train_args: list[str], count: bool) -> None:
    """``n`` ranks of :func:`volume_worker` (gloo on CPU); raises with the failing rank's tail."""
    port, threads = _free_port(), max(1, (os.cpu_count() or 1) // n)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "_volume-worker", str(out_dir)]
    cmd += ([] if count else ["--no-count"]) + ["--", *train_args]
    procs, logs = [], []
    for rank in range(n):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=path,
        )
        env.setdefault("OMP_NUM_THREADS", str(threads))
        logs.append(open(out_dir / f"rank{rank}.log", "w"))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[-1], stderr=logs[-1]))
    failed = None
    while failed is None and any(p.poll() is None for p in procs):
        failed = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        time.sleep(0.2)
    for p in procs:  # a rank that died leaves the others waiting in a collective: stop them
        if p.poll() is None:
            p.kill()
        p.wait()
    for log in logs:
        log.close()
    if failed is None:  # one that failed in the last moments (else: the first that failed)
        failed = next((r for r, p in enumerate(procs) if p.returncode != 0), None)
    if failed is not None:
        tail = (out_dir / f"rank{failed}.log").read_text().strip().splitlines()[-15:]
        raise SystemExit(f"volume: rank {failed} failed:\n" + "\n".join(tail))


def _losses(dump: Path) -> dict[int, float]:
    from torchtitan.observability.tb_events import read_scalars

    return read_scalars(dump / "tb")


def observe_volume(a: argparse.Namespace, train_args: list[str], tmp: Path) -> dict:
    """The counted run (and with ``--check-losses`` the plain one): per-rank counts per step."""
    result: dict[str, Any] = {}
    runs = [("counted", True)] + ([("plain", False)] if a.check_losses else [])
    for name, count in runs:
        out = tmp / name
        out.mkdir()
        args = [*train_args, "--job.dump_folder", str(out / "dump")]
        launch_workers(a.ngpu, out, args, count)
        if a.check_losses:
            result[f"losses_{name}"] = _losses(out / "dump")
        if count:
            ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(a.ngpu)]
            result["ranks"] = ranks
    if a.check_losses:
        counted, plain = result["losses_counted"], result["losses_plain"]
        result["max_loss_diff"] = max(abs(counted[s] - plain[s]) for s in plain)
    return result


# --------------------------------------------------------------------------------------------
# volume: the comparison and its table
# --------------------------------------------------------------------------------------------


def compare_volume(computed: dict, ranks: list[dict], steps: int) -> dict:
    """Per phase: computed per rank and step, observed per rank (per step), and the checks."""
    phases, checks = {}, {}
    for phase in PHASES:
        want = computed["phases"][phase]
        got = [r.get(phase, {}) for r in ranks]
        rows = [g.get("rows", 0) for g in got]
        exact_each = phase in EXACT_PER_RANK
        checks[phase] = (
            all(x == want["rows"] * steps for x in rows) if exact_each else True
        ) and sum(rows) == want["rows"] * steps * len(ranks)
        phases[phase] = {
            "computed_rows": want["rows"],
            "computed_bytes": want["bytes"],
            "observed_rows": [x / steps for x in rows],
            "observed_bytes": [g.get("bytes", 0) / steps for g in got],
            "observed_leaves": [
                1 - g.get("rows_self", 0) / g["rows"] if g.get("rows") else None for g in got
            ],
            "observed_calls": [g.get("calls", 0) / steps for g in got],
            "exact_per_rank": exact_each,
        }
    return {"phases": phases, "rows_match": checks, "all_rows_match": all(checks.values())}


def _mib(nbytes: float) -> str:
    """MiB with 3 decimals; bytes below 1 KiB (the counts)."""
    return f"{nbytes / MIB:.3f}" if nbytes >= 1024 else f"{nbytes:.0f} B"


def format_volume(c: dict, v: dict, steps: int, ngpu: int) -> str:
    b = "bfloat16" if c["bytes_per_element"] == 2 else f"{c['bytes_per_element']} B per element"
    lines = [
        f"all-to-all volume per training step and rank: {c['model']}, {ngpu} processes "
        f"({c['layout']}); T = {c['tokens_per_rank_per_micro_batch']} tokens per rank per "
        f"micro-batch, top_k {c['top_k']}, dim {c['dim']}, {b}, {c['moe_layers']} MoE layers, "
        f"{c['micro_batches']} micro-batch(es)"
        + (f", each TP rank sends 1/{c['tp_share']} of them" if c["tp_share"] > 1 else "")
        + f"; observed: mean of {steps} steps",
        f"{'phase':<18} {'rows':>8} {'MiB':>8} {'leaves':>7} | "
        + " ".join(
            f"{'rank ' + str(r) + ' rows':>12} {'MiB':>7} {'leaves':>6}" for r in range(ngpu)
        )
        + f" | {'rows match':>10}",
    ]
    total_c, total_o = 0.0, [0.0] * ngpu
    for phase in PHASES:
        p = v["phases"][phase]
        total_c += p["computed_bytes"]
        cells = []
        for r in range(ngpu):
            total_o[r] += p["observed_bytes"][r]
            left = p["observed_leaves"][r]
            cells.append(
                f"{p['observed_rows'][r]:>12,.1f} {_mib(p['observed_bytes'][r]):>7} "
                + (f"{left:>6.1%}" if left is not None else f"{'-':>6}")
            )
        match = ("yes" if v["rows_match"][phase] else "NO") + (
            " (rank)" if p["exact_per_rank"] else " (sum)"
        )
        # the counts go to every EP rank, whatever rows a rank sends
        counts = (c["ep"] - 1) / c["ep"]
        leaves = counts if phase.startswith("counts") else c["leaves_fraction"]
        lines.append(
            f"{phase:<18} {p['computed_rows']:>8,} {_mib(p['computed_bytes']):>8} "
            f"{leaves:>7.1%} | " + " ".join(cells) + f" | {match:>10}"
        )
    lines.append(
        f"{'total':<18} {'':>8} {total_c / MIB:>8.3f} {'':>7} | "
        + " ".join(f"{'':>12} {t / MIB:>7.3f} {'':>6}" for t in total_o)
    )
    lines.append(
        "computed: under balanced routing (leaves: the share sent to other ranks); rows match: "
        "the observed rows over the run equal the computed ones on every rank (rank: "
        "routing-independent) or summed over the ranks (sum: where they go is data-dependent)"
    )
    return "\n".join(lines)


def cmd_volume(a: argparse.Namespace, overrides: list[str]) -> int:
    from torchtitan.config.parse import parse_args
    from torchtitan.errors import TorchTitanError

    with tempfile.TemporaryDirectory(prefix="moe-volume-") as tmp:
        tmp_path = Path(a.keep or tmp)
        tmp_path.mkdir(parents=True, exist_ok=True)
        train_args = [
            "--job.config_file",
            a.config,
            "--parallelism.expert_parallel_degree",
            str(a.ep or a.ngpu),
            *overrides,
            "--training.steps",
            str(a.steps),
            "--metrics.log_freq",
            "1",
            "--checkpoint.enable",
            "false",
            "--metrics.enable_tensorboard",
            "true",
            "--metrics.save_tb_folder",
            "tb",
        ]
        try:
            job_config = parse_args([*train_args, "--job.dump_folder", str(tmp_path / "plan")])
        except TorchTitanError as e:
            raise SystemExit(f"volume: {e}") from None
        computed = computed_volume(job_config, a.ngpu)
        if computed["ep"] < 2:
            raise SystemExit("volume: needs expert parallelism (ep >= 2)")
        observed = observe_volume(a, train_args, tmp_path)
    volume = compare_volume(computed, observed["ranks"], a.steps)
    if a.json:
        print(json.dumps({"computed": computed, "observed": observed, "volume": volume}))
    else:
        print(format_volume(computed, volume, a.steps, a.ngpu))
        if a.check_losses:
            print(f"losses with and without the counters: max |diff| {observed['max_loss_diff']}")
    return 0 if volume["all_rows_match"] else 1


# --------------------------------------------------------------------------------------------
# layouts: tokens/s through train_throughput.py
# --------------------------------------------------------------------------------------------


def layout_settings(global_batch: int) -> list[tuple[str, int, str]]:
    """(name, processes, overrides) of the four layouts, each with the same global batch."""
    ep2 = "--parallelism.expert_parallel_degree 2"
    layouts = [("1 process", 1, ""), ("FSDP 2", 2, ""), ("EP 2", 2, ep2), ("EP 2 x FSDP 2", 4, ep2)]
    out = []
    for name, n, extra in layouts:
        if global_batch % n:
            raise SystemExit(f"--global-batch {global_batch} must be a multiple of {n}")
        local = f"--training.local_batch_size {global_batch // n}"
        out.append((name, n, f"--ngpu {n} {local} {extra}".strip()))
    return out


def format_layouts(rows: list[dict], config: str, steps: int, warmup: int, gb: int) -> str:
    lines = [
        f"{config}: global batch {gb} sequences in every layout, steps {warmup + 1}-{steps} "
        "measured",
        f"{'layout':<16} {'procs':>5} {'tokens/s':>9} {'per dev':>8} {'step s':>7} "
        f"{'peak GiB':>9} {'speed':>6} {'loss':>7} {'loss gap':>9}",
    ]
    first = next((r for r in rows if "error" not in r), None)
    for r in rows:
        if "error" in r:
            lines.append(f"{r['setting']:<16} {r['ngpu']:>5} failed: {r['error']}")
            continue
        total = r["tokens_per_s_per_device"] * r["ngpu"]
        speed = total / (first["tokens_per_s_per_device"] * first["ngpu"])
        lines.append(
            f"{r['setting']:<16} {r['ngpu']:>5} {total:>9,.0f} "
            f"{r['tokens_per_s_per_device']:>8,.0f} {r['step_time_s']:>7.3f} "
            f"{r['peak_memory_gib']:>9.2f} {speed:>5.2f}x {r['final_loss']:>7.4f} "
            f"{r['max_loss_gap_vs_first']:>9.2e}"
        )
    lines.append(
        "tokens/s: all processes together (per device x procs); speed: against the first layout; "
        "peak GiB: rank 0's; loss gap: the largest per-step |loss difference| from the first"
    )
    return "\n".join(lines)


def cmd_layouts(a: argparse.Namespace, overrides: list[str]) -> int:
    settings = layout_settings(a.global_batch)
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "train_throughput.py"),
        "--json",
        "--config",
        a.config,
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
    ]
    for name, _, extra in settings:
        cmd += ["--setting", f"{name}={extra}"]
    out = subprocess.run([*cmd, "--", *overrides], cwd=ROOT, capture_output=True, text=True)
    if not out.stdout.strip():
        raise SystemExit(f"train_throughput.py failed:\n{out.stderr[-3000:]}")
    rows = json.loads(out.stdout)["rows"]
    if a.json:
        print(json.dumps({"config": a.config, "global_batch": a.global_batch, "rows": rows}))
    else:
        print(format_layouts(rows, a.config, a.steps, a.warmup, a.global_batch))
    return out.returncode


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="grouped-mm against the per-expert loop")
    k.add_argument(
        "--sizes",
        default="llama4-debug,qwen3-debug,many,big",
        help=f"commas: {', '.join(KERNEL_SIZES)}",
    )
    k.add_argument("--warmup", type=int, default=1)
    k.add_argument("--rounds", type=int, default=5)
    k.add_argument("--steps", type=int, default=2, help="calls of each kernel per round")
    k.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    k.add_argument("--dtype", default="float32", choices=tuple(DTYPES))
    k.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    v = sub.add_parser("volume", help="all-to-all bytes per step: computed and observed")
    v.add_argument("--config", default="train_configs/llama4_debug.toml")
    v.add_argument("--ngpu", type=int, default=2, help="processes")
    v.add_argument("--ep", type=int, default=0, help="expert_parallel_degree (0: --ngpu)")
    v.add_argument("--steps", type=int, default=3)
    v.add_argument("--keep", help="keep the workers' logs and dump folders under this folder")
    v.add_argument(
        "--check-losses",
        action="store_true",
        help="run once more without the counters and compare the losses",
    )
    lay = sub.add_parser("layouts", help="tokens/s: 1 process, FSDP 2, EP 2, EP 2 x FSDP 2")
    lay.add_argument("--config", default="train_configs/llama4_debug.toml")
    lay.add_argument("--steps", type=int, default=12)
    lay.add_argument("--warmup", type=int, default=4)
    lay.add_argument("--global-batch", type=int, default=8, help="sequences per step")
    w = sub.add_parser("_volume-worker")
    w.add_argument("out_dir")
    w.add_argument("--no-count", action="store_true")
    for p in (k, v, lay):
        p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    else:
        extra = []
    a = parser.parse_args(argv)
    if a.cmd == "kernels" and min(a.warmup, a.rounds - 1, a.steps - 1) < 0:
        parser.error("--rounds and --steps must be >= 1, --warmup >= 0")
    return a, extra


def main(argv: list[str] | None = None) -> int:
    a, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    if a.cmd == "kernels":
        return cmd_kernels(a)
    if a.cmd == "volume":
        return cmd_volume(a, extra)
    if a.cmd == "layouts":
        return cmd_layouts(a, extra)
    return volume_worker(a.out_dir, extra, count=not a.no_count)


if __name__ == "__main__":
    sys.exit(main())
