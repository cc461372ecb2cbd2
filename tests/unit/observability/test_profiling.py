"""The profiler schedule's config check. The traces per rank on the schedule, and the CPU message
for memory snapshots, from a training run, are in tests/e2e/test_profiling.py."""

from __future__ import annotations

import pytest

from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError


def test_warmup_and_active_steps_must_fit_the_frequency():
    with pytest.raises(
        ConfigError,
        match=r"profiling.profiler_warmup \(default\): profiler_warmup \+ "
        r"profiler_active \(3 \+ 1\) "
        r"must be <= profiling.profile_freq \(2\)",
    ):
        parse_args(["--profiling.enable_profiling", "--profiling.profile_freq", "2"])
