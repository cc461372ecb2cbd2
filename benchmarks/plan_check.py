"""The layout planner's predictions against real runs of the same layouts, on this machine.

    python benchmarks/plan_check.py [--ngpu 4] [--steps 10] [--warmup 4] [--json] \\
        [--calibration FILE] [-- extra train.py arguments for every layout]

Each layout trains the debug model (``train_configs/debug_model.toml``; by default the global
batch is 16 sequences of 512 tokens, every layout the same) on ``--ngpu`` CPU processes
(torchrun over gloo, ``OMP_NUM_THREADS`` as ``run_llama_train.sh`` sets it). Measured per
layout: the step time (the median gap between rank 0's logged steps after ``--warmup``) and
each rank's peak resident set above its start (glibc's mmap threshold fixed, as
``tests/e2e/test_estimate_memory.py`` measures). Predicted per layout, by the planner's own
functions: the step time of the cost model with this machine's rates (``benchmarks/ceilings.py
--collectives`` under torchrun with the same processes, run first unless ``--calibration`` is
given) and the traced peak (the fast trace, ``cpu`` rules). The table ends with the Spearman
rank correlation of predicted and measured step times and each layout's memory error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> overrides (the degrees not given are 1; data_parallel_shard_degree takes the rest)
LAYOUTS = {
    "fsdp4": [],
    "fsdp4 ac-full": ["--activation_checkpoint.mode", "full"],
    "fsdp4 ac-op": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.selective_ac_option",
        "op",
    ],
    "ddp4": ["--parallelism.data_parallel_replicate_degree", "4"],
    "hsdp2x2": ["--parallelism.data_parallel_replicate_degree", "2"],
    "tp2 fsdp2": ["--parallelism.tensor_parallel_degree", "2"],
    "tp2 fsdp2 ac-full": [
        "--parallelism.tensor_parallel_degree",
        "2",
        "--activation_checkpoint.mode",
        "full",
    ],
    "tp4": ["--parallelism.tensor_parallel_degree", "4"],
    "cp2 fsdp2": ["--parallelism.context_parallel_degree", "2"],
    "pp2 fsdp2 1F1B": [
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        "1F1B",
        "--parallelism.pipeline_parallel_microbatch_size",
        "2",
    ],
}
BATCH = ["--training.global_batch_size", "16", "--training.seq_len", "512"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ngpu", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--calibration", help="the JSON of ceilings.py --collectives (else measured)")
    p.add_argument("--only", action="append", help="run only these layouts (by name)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # under torchrun: one layout's run
    a, extra = p.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if a.worker:
        return _worker(a.worker, extra)
    names = a.only or list(LAYOUTS)
    with tempfile.TemporaryDirectory(prefix="plan-check-") as tmp:
        calibration = a.calibration or _calibrate(Path(tmp), a.ngpu)
        rows = []
        for name in names:
            args = [*BATCH, *LAYOUTS[name], *extra]
            row = {"layout": name, **_predict(args, a.ngpu, calibration)}
            row.update(_measure(Path(tmp) / name.replace(" ", "_"), args, a, extra))
            rows.append(row)
            print(f"{name}: {row}", file=sys.stderr, flush=True)
    summary = _summary(rows)
    if a.json:
        print(json.dumps({"rows": rows, **summary}))
    else:
        print(format_table(rows, summary, a))
    return 0


def _env(threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    env["MALLOC_MMAP_THRESHOLD_"] = "65536"  # freed blocks go back at once: RSS follows tensors
    return env


def _threads(ngpu: int) -> int:
    return max(1, (os.cpu_count() or 1) // ngpu)  # as run_llama_train.sh on a CPU machine


def _calibrate(tmp: Path, ngpu: int) -> str:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ngpu}",
            str(ROOT / "benchmarks" / "ceilings.py"),
            "--collectives",
            "--size",
            "1024",
            "--json",
        ],
        env=_env(_threads(ngpu)),
        capture_output=True,
        text=True,
        check=True,
    )
    path = tmp / "calibration.json"
    path.write_text(out.stdout.strip().splitlines()[-1])
    return str(path)


def _predict(args: list[str], ngpu: int, calibration: str) -> dict:
    """The planner's step time (cost model) and traced peak for this layout."""
    from torchtitan.config.parse import parse_args
    from torchtitan.planning.calibrate import cpu_hardware
    from torchtitan.planning.cost import step_cost
    from torchtitan.planning.layouts import config_layout
    from torchtitan.planning.planner import _facts
    from torchtitan.train.memory_estimate import estimate_job

    config = ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml")]
    job_config = parse_args([*config, *args], need_files=False)
    lay = config_layout(job_config, ngpu)
    dp = lay.dp_replicate * lay.dp_shard
    gb = job_config.training.global_batch_size
    lay = type(lay)(**{**lay.__dict__, "local_batch": gb // dp, "accum": 1})
    job_config.training.local_batch_size = lay.local_batch
    hw = cpu_hardware(calibration, ngpu)
    cost = step_cost(_facts(job_config), lay, hw, job_config.training.seq_len, reduce_bytes=4)
    estimate = estimate_job(job_config, ngpu, "cpu", fast=True)
    return {
        "predicted_step_s": cost.seconds,
        "predicted_terms_s": cost.terms,
        "predicted_limit": cost.limit,
        "predicted_peak_gib": estimate["peak_gib"] + hw.runtime_gib,
        "traced_peak_gib": estimate["peak_gib"],
        "local_batch": lay.local_batch,
    }


def _measure(dump: Path, args: list[str], a: argparse.Namespace, extra: list[str]) -> dict:
    from train_throughput import measured_run, summarize

    lay_args = [
        "--job.config_file",
        str(ROOT / "train_configs" / "debug_model.toml"),
        *args,
        "--training.local_batch_size",
        str(16 // _dp(args, a.ngpu)),
        *measured_run(a.steps, dump),
    ]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={a.ngpu}",
            str(Path(__file__).resolve()),
            "--worker",
            str(dump / "memory"),
            "--",
            *lay_args,
        ],
        env=_env(_threads(a.ngpu)),
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:  # the worker's own one-line error, else torchrun's last line
        lines = (out.stdout + out.stderr).strip().splitlines()
        return {"error": [x for x in lines if x.startswith("error: ")][:1] or lines[-1:]}
    ranks = [json.loads(f.read_text()) for f in sorted((dump / "memory").glob("rank_*.json"))]
    measured = summarize(dump, a.warmup)
    return {
        "measured_step_s": measured["step_time_s"],
        "measured_peak_gib": max(r["peak_above_start_gib"] for r in ranks),
        "final_loss": measured["final_loss"],
    }


def _dp(args: list[str], ngpu: int) -> int:
    from torchtitan.config.parse import parse_args
    from torchtitan.planning.layouts import config_layout

    cfg = parse_args(
        ["--job.config_file", str(ROOT / "train_configs" / "debug_model.toml"), *args],
        need_files=False,
    )
    lay = config_layout(cfg, ngpu)
    return lay.dp_replicate * lay.dp_shard


def _worker(folder: str, train_args: list[str]) -> int:
    """One rank of a measured run: its peak resident set above its start, to ``folder``."""
    import datasets  # noqa: F401  (imported before the start: code pages are not training's)
    import tiktoken  # noqa: F401
    import torch  # noqa: F401

    import train
    from torchtitan.observability import metrics
    from torchtitan.observability.metrics import proc_status_kib

    peaks = []
    reset = metrics.reset_peak_memory

    def keep_peak_then_reset() -> None:  # the loop resets the peak after each logged step
        peaks.append(proc_status_kib("VmHWM"))
        reset()

    metrics.reset_peak_memory = keep_peak_then_reset
    start = proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) from the current resident set on
    rc = train.main(train_args)
    peak = max([*peaks, proc_status_kib("VmHWM")])
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    rank = os.environ.get("RANK", "0")
    (out / f"rank_{rank}.json").write_text(
        json.dumps({"peak_above_start_gib": (peak - start) / 1024**2})
    )
    return rc


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else 0.0


def _summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        r["memory_error"] = r["predicted_peak_gib"] / r["measured_peak_gib"] - 1
    return {
        "spearman_step_time": spearman(
            [r["predicted_step_s"] for r in ok], [r["measured_step_s"] for r in ok]
        )
        if len(ok) > 1
        else None,
        "largest_memory_error": max((abs(r["memory_error"]) for r in ok), default=None),
        "layouts_measured": len(ok),
    }


def format_table(rows: list[dict], summary: dict, a: argparse.Namespace) -> str:
    lines = [
        f"debug model, {a.ngpu} CPU processes, global batch 16 x 512, steps {a.warmup + 1}-"
        f"{a.steps} measured",
        f"{'layout':20} {'step s':>8} {'predicted':>10} {'limit':>10} "
        f"{'peak GiB':>9} {'predicted':>10} {'error':>7}",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['layout']:20} failed: {r['error']}")
            continue
        lines.append(
            f"{r['layout']:20} {r['measured_step_s']:8.3f} {r['predicted_step_s']:10.3f} "
            f"{r['predicted_limit']:>10} {r['measured_peak_gib']:9.3f} "
            f"{r['predicted_peak_gib']:10.3f} {100 * r['memory_error']:+6.1f}%"
        )
    rho = summary["spearman_step_time"]
    lines.append(
        f"Spearman rank correlation of step times: {rho:.2f}; largest memory error "
        f"{100 * summary['largest_memory_error']:.1f}%"
        if rho is not None
        else "fewer than two layouts measured"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.exit(main())
