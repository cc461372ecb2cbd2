"""``benchmarks/mla.py`` at a tiny size: both tables, the attention variants at about equal
parameters, and the MTP step with its depth costing more than without."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mla_benchmark_tables():
    out = subprocess.run(
        [sys.executable, "benchmarks/mla.py", "--batch", "1", "--seq", "32", "--rounds", "1"]
        + ["--threads", "1", "--json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    mla, gqa = result["attention"]
    assert (mla["attention"], gqa["attention"]) == ("mla", "gqa")
    assert abs(mla["parameters"] - gqa["parameters"]) < 0.1 * mla["parameters"]
    assert mla["kv_cache_per_token"] == 128 + 64 and gqa["kv_cache_per_token"] == 2 * 4 * 64
    assert all(r["ms"] > 0 for r in result["attention"] + result["mtp"])
    without, with_depth = result["mtp"]
    assert with_depth["parameters"] > without["parameters"]
    assert with_depth["vs_without"] == with_depth["ms"] / without["ms"]
