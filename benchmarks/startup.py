"""Start-up time: from launch to the first finished step, broken down by phase.

    python benchmarks/startup.py [--repeats 3] [--launcher python|torchrun] [--json] \\
        [train.py arguments, default: the debug model config]

Each repeat launches a fresh process (``python train.py`` or ``./run_llama_train.sh`` with
NGPU=1, which adds the launcher's preflight and torchrun) for one step and reads the
``Start-up ...`` line train.py logs after its first step (phases from process start: start and
imports, config and process group, tokenizer and data, model on meta, parallelize and
materialize, optimizer/metrics/checkpoint, first step). The wall time from launch to that line is
measured outside too. The table shows the median of each phase over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"Start-up ([\d.]+)s, process start to the end of the first step \((.*)\)")
PHASE = re.compile(r"(.+?) ([\d.]+)s(?:, |$)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--launcher", choices=("python", "torchrun"), default="python")
    parser.add_argument("--json", action="store_true")
    a, train_args = parser.parse_known_args()
    train_args = train_args or ["--job.config_file", "train_configs/debug_model.toml"]
    runs = [measure(train_args, a.launcher) for _ in range(a.repeats)]
    phases = {
        name: statistics.median(r["phases"][name] for r in runs) for name in runs[0]["phases"]
    }
    result = {
        "launcher": a.launcher,
        "repeats": a.repeats,
        "launch_to_first_step_s": statistics.median(r["wall_s"] for r in runs),
        "phases_s": phases,
    }
    if a.json:
        print(json.dumps(result))
        return 0
    print(
        f"launch to first finished step ({a.launcher}, median of {a.repeats}): "
        f"{result['launch_to_first_step_s']:.2f}s"
    )
    for name, secs in phases.items():
        print(f"  {name:32} {secs:6.2f}s")
    return 0


def measure(train_args: list[str], launcher: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="startup-") as dump:
        args = [*train_args, "--training.steps", "1", "--job.dump_folder", dump]
        if launcher == "python":
            cmd = [sys.executable, "train.py", *args]
        else:
            cmd = ["bash", "run_llama_train.sh", *args]
        env = dict(os.environ, NGPU="1", PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        found = None
        for line in proc.stdout:
            m = LINE.search(line)
            if m and found is None:
                found = (time.perf_counter() - t0, m.group(2))
        if proc.wait() != 0 or found is None:
            raise SystemExit(
                f"error: {' '.join(cmd)} exited {proc.returncode} without a start-up line"
            )
    wall, text = found
    return {"wall_s": wall, "phases": {n: float(s) for n, s in PHASE.findall(text)}}


if __name__ == "__main__":
    sys.exit(main())
