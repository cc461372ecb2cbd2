"""Profiler traces per rank on the schedule, and the CPU message for memory snapshots (the
schedule's config check is in tests/unit/observability/test_profiling.py)."""

from __future__ import annotations

import json

import pytest
from launcher import pooled


@pytest.mark.slow
def test_traces_are_written_per_rank_on_the_schedule(pools, tmp_path):
    out = pooled(
        pools,
        tmp_path,
        "--training.steps",
        "4",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--profiling.enable_profiling",
        "--profiling.profile_freq",
        "2",
        "--profiling.profiler_warmup",
        "0",
        "--profiling.enable_memory_snapshot",
        ngpu=2,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CUDA memory snapshots need a GPU; none are written on this CPU run" in out.stdout
    traces = tmp_path / "out" / "profile_traces"
    assert sorted(p.relative_to(traces).as_posix() for p in traces.rglob("*.json")) == [
        f"iteration_{step}/rank{rank}_trace.json" for step in (2, 4) for rank in (0, 1)
    ]
    for path in traces.rglob("*.json"):
        names = {e.get("name", "") for e in json.loads(path.read_text())["traceEvents"]}
        # one traced step (profiler_active 1), with the model's matmuls and FSDP's collectives
        assert sum(n.startswith("ProfilerStep#") for n in names) == 1, path
        assert "aten::mm" in names and "gloo:all_gather" in names, path
    assert not (tmp_path / "out" / "memory_snapshot").exists()
