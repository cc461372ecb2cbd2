"""Training throughput of the real train.py path, one row per setting.

    python benchmarks/train_throughput.py [--config FILE] [--ngpu N] [--steps 30] [--warmup 10]
        [--setting NAME=OVERRIDES ...] [--json] [-- extra train.py arguments for every setting]

Each setting is a name and the ``--section.key value`` overrides it adds, e.g.
``--setting "compile=--compile.enable"`` or ``--setting "ac full=--activation_checkpoint.mode full"``
(``NAME=`` alone is the config as it is; ``--ngpu N`` among the overrides gives that setting
its own process count, e.g. ``--setting "fsdp2=--ngpu 2"``). Every setting runs
``./run_llama_train.sh`` (torchrun, ``NGPU`` processes) in a fresh dump folder with TensorBoard
on and ``metrics.log_freq 1``, then the table is built from rank 0's TensorBoard events of the
steps after ``--warmup``:

* step time: the median gap between consecutive steps' event wall times (the whole loop,
  logging included);
* tokens/s per device, TFLOPs per device and MFU: the median of the logged values (see
  docs/metrics.md; MFU is n/a on CPU);
* peak memory: the largest logged peak (GPU: max allocated; CPU: peak resident set);
* speed and loss gap against the first setting: its tokens/s ratio, and the largest per-step
  |loss difference| over all steps (seeds and data are the same, so a float8 or compile setting
  shows here whether it trains like the baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="train_configs/debug_model.toml")
    parser.add_argument("--ngpu", type=int, default=1, help="processes (GPUs) per run")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out")
    parser.add_argument("--setting", action="append", default=[], help="NAME=OVERRIDES")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", help="keep the runs' dump folders under this folder")
    a, extra = parser.parse_known_args()
    extra = [x for x in extra if x != "--"]
    if a.warmup + 2 > a.steps:
        parser.error(f"--steps {a.steps} must exceed --warmup {a.warmup} by at least 2")
    settings = [_parse_setting(s, parser, a.ngpu) for s in (a.setting or ["default="])]
    rows = []
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        base = Path(a.keep or tmp)
        for i, (name, overrides, ngpu) in enumerate(settings):
            dump = base / f"run{i}"
            args = [*extra, *overrides, *measured_run(a.steps, dump)]
            rc, tail = _run(a.config, ngpu, args)
            if rc != 0:
                rows.append({"setting": name, "ngpu": ngpu, "error": tail})
                continue
            rows.append({"setting": name, "ngpu": ngpu, **summarize(dump, a.warmup)})
    compare_to_first(rows)
    if a.json:
        print(json.dumps({"config": a.config, "ngpu": a.ngpu, "rows": rows}))
    else:
        print(format_table(rows, a.config, a.ngpu, a.steps, a.warmup))
    return 1 if any("error" in r for r in rows) else 0


def measured_run(steps: int, dump: Path) -> list[str]:
    """``train.py`` arguments of a measured run: ``steps`` steps, each logged to TensorBoard
    under ``dump/tb`` (what :func:`summarize` reads)."""
    return [
        "--training.steps", str(steps), "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "true", "--metrics.save_tb_folder", "tb",
        "--job.dump_folder", str(dump),
    ]  # fmt: skip


def _parse_setting(text: str, parser, ngpu: int) -> tuple[str, list[str], int]:
    """(name, overrides, processes): ``--ngpu N`` in the overrides is the setting's own count."""
    if "=" not in text:
        parser.error(f"--setting {text!r}: give NAME=OVERRIDES, e.g. 'compile=--compile.enable'")
    name, overrides = text.split("=", 1)
    args = shlex.split(overrides)
    if "--ngpu" in args:
        i = args.index("--ngpu")
        if i + 1 == len(args) or not args[i + 1].isdigit() or int(args[i + 1]) < 1:
            parser.error(f"--setting {text!r}: --ngpu needs a process count >= 1")
        ngpu = int(args[i + 1])
        del args[i : i + 2]
    return name.strip(), args, ngpu


def _run(config: str, ngpu: int, args: list[str]) -> tuple[int, str]:
    """One launch; stopped (SIGTERM, e.g. a time limit), it stops the launcher first, whose
    workers are in sessions of their own, and waits for it, then exits 143."""
    env = dict(os.environ, CONFIG_FILE=config, NGPU=str(ngpu), LOG_RANK="0")
    proc = subprocess.Popen(
        ["bash", str(ROOT / "run_llama_train.sh"), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stopped = []
    previous = signal.signal(signal.SIGTERM, lambda *_: stopped.append(proc.terminate()))
    try:
        stdout, stderr = proc.communicate()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if stopped:
        raise SystemExit(143)
    lines = (stdout + stderr).strip().splitlines()
    return proc.returncode, next(
        (ln for ln in reversed(lines) if ln.startswith("error")), lines[-1] if lines else ""
    )


def summarize(dump: Path, warmup: int) -> dict:
    """The measured steps (after ``warmup``) of one run, from rank 0's TensorBoard events."""
    from torchtitan.observability.tb_events import read_all_events

    tb = dump / "tb"
    if (tb / "rank_0").is_dir():  # metrics.save_for_all_ranks
        tb = tb / "rank_0"
    events = read_all_events(tb)  # every tag, the event files read once
    times = events["loss"]
    steps = sorted(s for s in times if s > warmup)
    gaps = [times[s][0] - times[s - 1][0] for s in steps if s - 1 in times]

    def median(tag: str) -> float | None:
        values = events.get(tag, {})
        measured = [values[s][1] for s in steps if s in values]
        return statistics.median(measured) if measured else None

    memory = events["memory/peak_active_gib"]
    return {
        "steps_measured": len(gaps),
        "step_time_s": statistics.median(gaps),
        "tokens_per_s_per_device": median("throughput/tps"),
        "tflops_per_device": median("throughput/tflops"),
        "mfu_pct": median("throughput/mfu_pct"),
        "peak_memory_gib": max(memory[s][1] for s in steps if s in memory),
        "final_loss": times[max(times)][1],
        "losses": {s: times[s][1] for s in sorted(times)},  # every step, warm-up included
    }


def compare_to_first(rows: list[dict]) -> None:
    """Add each row's speed and its largest per-step loss gap, both against the first row."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return
    first = ok[0]
    for r in ok:
        common = set(r["losses"]) & set(first["losses"])
        r["speedup_vs_first"] = r["tokens_per_s_per_device"] / first["tokens_per_s_per_device"]
        r["max_loss_gap_vs_first"] = max(
            (abs(r["losses"][s] - first["losses"][s]) for s in common), default=None
        )


def format_table(rows: list[dict], config: str, ngpu: int, steps: int, warmup: int) -> str:
    head = (
        f"{'setting':24} {'tokens/s/dev':>13} {'TFLOPs/dev':>11} {'MFU':>7} "
        f"{'peak GiB':>9} {'step s':>8} {'loss':>7} {'speed':>6} {'loss gap':>9}"
    )
    counts = sorted({r.get("ngpu", ngpu) for r in rows})
    procs = f"{ngpu} process(es)"
    if counts != [ngpu]:
        procs = "/".join(map(str, counts)) + " processes (per setting: [N])"
    lines = [f"{config}, {procs}, steps {warmup + 1}-{steps} measured", head]
    for r in rows:
        if counts != [ngpu]:  # settings with their own process counts say theirs
            r = {**r, "setting": f"{r['setting']} [{r['ngpu']}]"}
        if "error" in r:
            lines.append(f"{r['setting']:24} failed: {r['error']}")
            continue
        mfu = f"{r['mfu_pct']:6.1f}%" if r["mfu_pct"] is not None else "    n/a"
        lines.append(
            f"{r['setting']:24} {r['tokens_per_s_per_device']:13,.0f} "
            f"{r['tflops_per_device']:11.2f} {mfu} {r['peak_memory_gib']:9.2f} "
            f"{r['step_time_s']:8.3f} {r['final_loss']:7.4f} "
            f"{r['speedup_vs_first']:5.2f}x {r['max_loss_gap_vs_first']:9.2e}"
        )
    lines.append(
        "speed: tokens/s against the first setting; loss gap: the largest |loss difference| from "
        "the first setting at any step (1 to the last)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
