"""The hybrid linear-attention benchmark (benchmarks/hybrid_attention.py, imported, not run as a
process): at a short sequence every row trains a step and reports a positive speed and
activations."""

from __future__ import annotations

from repo_paths import load_script

BENCH = load_script("hybrid_attention", folder="benchmarks")


def test_every_row_trains_a_step():
    rows = BENCH.measure(t=100, n_layers=4, rounds=1)
    assert list(rows) == ["softmax", "hybrid", "linear"]
    assert all(r["tok_per_s"] > 0 and r["kib_per_token"] > 0 for r in rows.values()), rows
    assert BENCH._layer_types("hybrid", 4) == ("linear_attention",) * 3 + ("full_attention",)
