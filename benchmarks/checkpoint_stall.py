"""How long a checkpoint save stops the training loop, per ``checkpoint.async_mode``.

Runs ``./run_llama_train.sh`` once per mode with the same config, saving every few steps, and
reads the save lines the checkpoint manager logs on rank 0:

* ``disabled``: ``Saved ... in X s`` -- the loop waits for the whole write (X is the stall);
* ``async`` / ``async_with_pinned_mem``: ``... in the background (training resumed after X s)``
  is the stall, and ``written Y s after training resumed`` how long the write went on behind
  training.

Usage (CPU, the debug model; on a GPU pass a real config and NGPU)::

    python benchmarks/checkpoint_stall.py [--ngpu 2] [--steps 20] [--interval 5] \\
        [-- --job.config_file train_configs/llama3_2_1b.toml ...]

Prints one table row per mode: saves, mean and max stall per save, mean background write time.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("disabled", "async", "async_with_pinned_mem")
SYNC = re.compile(r"Saved \w+ \w+ at step \d+ to \S+ in ([\d.]+)s")
STALL = re.compile(r"in the background \(training resumed after ([\d.]+)s\)")
WRITE = re.compile(r"written ([\d.]+)s after training resumed")


def run_mode(mode: str, ngpu: int, steps: int, interval: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, NGPU=str(ngpu), PYTHON=sys.executable)
        cmd = [
            str(ROOT / "run_llama_train.sh"),
            "--job.dump_folder",
            tmp,
            "--training.steps",
            str(steps),
            "--checkpoint.enable",
            "--checkpoint.interval",
            str(interval),
            "--checkpoint.async_mode",
            mode,
            "--metrics.log_freq",
            str(steps),
            *extra,
        ]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: mode {mode} failed:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    log = out.stdout
    stalls = [float(x) for x in (SYNC if mode == "disabled" else STALL).findall(log)]
    writes = [float(x) for x in WRITE.findall(log)]
    return {"mode": mode, "saves": len(stalls), "stalls": stalls, "writes": writes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ngpu", type=int, default=1, help="processes (GPUs or CPU workers)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--interval", type=int, default=5, help="save every N steps")
    parser.add_argument("extra", nargs="*", help="train.py arguments (after --)")
    args = parser.parse_args()
    rows = [run_mode(m, args.ngpu, args.steps, args.interval, args.extra) for m in MODES]
    print(
        f"\n{'async_mode':<24}{'saves':>6}{'stall mean (s)':>16}{'stall max (s)':>15}"
        f"{'background write (s)':>22}"
    )
    for r in rows:
        write = f"{statistics.mean(r['writes']):.3f}" if r["writes"] else "-"
        print(
            f"{r['mode']:<24}{r['saves']:>6}{statistics.mean(r['stalls']):>16.3f}"
            f"{max(r['stalls']):>15.3f}{write:>22}"
        )


if __name__ == "__main__":
    main()
