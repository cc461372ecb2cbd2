"""Validation: the one-line config errors. The losses and perplexity under FSDP and PP, and a
whole-dataset pass on every rank, from training runs, are in tests/e2e/test_validation.py."""

from __future__ import annotations

import pytest

from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError
from torchtitan.train.plan import plan_job


def test_validation_shape_errors_name_the_key():
    cfg = parse_args(
        [
            "--validation.enable",
            "--validation.dataset",
            "python_docs",
            "--validation.seq_len",
            "4096",
        ]
    )
    with pytest.raises(ConfigError, match=r"validation.seq_len: 4096 is longer than training"):
        plan_job(cfg, world_size=1)
    cfg = parse_args(
        [
            "--validation.enable",
            "--validation.dataset",
            "python_docs",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--validation.local_batch_size",
            "3",
        ]
    )
    with pytest.raises(ConfigError, match=r"with pp=2 validation batches must have the training"):
        plan_job(cfg, world_size=2)
    cfg = parse_args(["--validation.enable", "--validation.dataset", "c7"])
    with pytest.raises(ConfigError, match=r"^command line: --validation.dataset: unknown dataset"):
        plan_job(cfg, world_size=1)
