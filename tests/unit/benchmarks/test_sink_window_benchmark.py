"""The gpt-oss attention benchmark (benchmarks/sink_window.py, imported, not run as a process):
at a short sequence every row runs forward and backward and gets a positive time."""

from __future__ import annotations

from repo_paths import load_script

BENCH = load_script("sink_window", folder="benchmarks")


def test_every_row_runs_forward_and_backward():
    times = BENCH.measure(t=300, heads=2, kv_heads=1, rounds=1, oracle_max=300)
    assert list(times) == ["causal", "causal + sinks", "window 128 + sinks", "written out (window)"]
    assert all(ms > 0 for ms in times.values()), times
    assert "written out (window)" not in BENCH.measure(300, 2, 1, 1, oracle_max=299)
