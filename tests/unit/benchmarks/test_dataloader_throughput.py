"""The data loader throughput benchmark's target (benchmarks/dataloader_throughput.py, imported,
not run). Its runs, as a process, are in tests/e2e/test_dataloader_throughput.py."""

from __future__ import annotations

import pytest
from repo_paths import load_script

BENCH = load_script("dataloader_throughput", folder="benchmarks")


def test_target_arithmetic():
    # 6 x 8.0e9 + 6 x 32 x 4096 x 8192 = 48e9 + 6.442e9 FLOPs per token
    assert BENCH.FLOPS_PER_TOKEN == pytest.approx(54.442e9, rel=1e-4)
    per_gpu = [m * 989e12 / BENCH.FLOPS_PER_TOKEN for m in (0.33, 0.39)]
    assert per_gpu == pytest.approx([5995, 7085], abs=1)
    assert BENCH.GPU_TOKENS_PER_S == 9000 and BENCH.REQUIRED_HEADROOM == 3
    assert "5,995" in BENCH.TARGET_DERIVATION and "7,085" in BENCH.TARGET_DERIVATION
