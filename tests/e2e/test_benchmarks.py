"""The benchmarks run the real paths and report consistent numbers (no timing thresholds:
performance is shown by the benchmarks themselves, see docs/performance.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launcher import train_env
from repo_paths import ROOT

SMALL = ["--training.local_batch_size", "2", "--training.seq_len", "64"]


def _bench(tmp_path, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args],
        cwd=ROOT, env=train_env(tmp_path), capture_output=True, text=True, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_train_throughput_table_from_the_real_runs(tmp_path):
    out = _bench(tmp_path, "train_throughput.py", "--steps", "5", "--warmup", "2", "--json",
                 "--setting", "base=", "--setting", "broken=--training.local_batch_size 0",
                 "--setting", "seed7=--debug.seed 7", "--", *SMALL)  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]  # one setting failed, and says why
    rows = {r["setting"]: r for r in json.loads(out.stdout)["rows"]}
    assert "training.local_batch_size" in rows["broken"]["error"]
    base = rows["base"]
    assert base["steps_measured"] == 3 and base["mfu_pct"] is None  # CPU: no MFU
    assert base["tokens_per_s_per_device"] > 0 and base["step_time_s"] > 0
    # tokens per step (2 x 64) over the step time is the logged rate, up to step-to-step noise
    assert 0.3 < base["tokens_per_s_per_device"] * base["step_time_s"] / 128 < 3
    assert base["peak_memory_gib"] > 0.1
    # against the first setting: itself exactly; another seed initializes other weights
    assert base["speedup_vs_first"] == 1 and base["max_loss_gap_vs_first"] == 0
    other = rows["seed7"]
    assert other["max_loss_gap_vs_first"] == max(
        abs(other["losses"][s] - base["losses"][s]) for s in base["losses"]
    )
    assert other["max_loss_gap_vs_first"] > 1e-3 and sorted(map(int, other["losses"])) == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert other["speedup_vs_first"] == pytest.approx(
        other["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
    )


@pytest.mark.slow
def test_plain_loop_reports_both_step_times_and_their_ratio(tmp_path):
    out = _bench(tmp_path, "plain_loop.py", "--steps", "6", "--warmup", "2", "--rounds", "1",
                 "--json", "--job.config_file", "train_configs/debug_model.toml",
                 "--metrics.log_freq", "2", *SMALL)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["library_step_s"] > 0 and r["plain_step_s"] > 0 and r["steps_measured"] == 4
    assert r["ratio"] == pytest.approx(r["library_step_s"] / r["plain_step_s"])


@pytest.mark.slow
def test_startup_breakdown_covers_the_launch(tmp_path):
    out = _bench(tmp_path, "startup.py", "--repeats", "1", "--json",
                 "--job.config_file", "train_configs/debug_model.toml", *SMALL)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    phases = r["phases_s"]
    assert list(phases) == ["start and imports", "config and process group", "tokenizer and data",
                            "model on meta", "parallelize and materialize",
                            "optimizer, metrics, checkpoint", "first step"]  # fmt: skip
    # the phases add up to the time from process start to the line (measured from outside too)
    assert sum(phases.values()) <= r["launch_to_first_step_s"] + 0.5
    assert sum(phases.values()) > 0.5 * r["launch_to_first_step_s"]


def test_plain_loop_refuses_steps_off_the_logging_grid(tmp_path):
    out = _bench(tmp_path, "plain_loop.py", "--steps", "7", "--warmup", "2")
    assert out.returncode == 2 and "multiples of metrics.log_freq (5)" in out.stderr
