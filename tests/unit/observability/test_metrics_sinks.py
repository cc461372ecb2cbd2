"""Where the metrics go: asking for Weights & Biases without the package is a config error. The
training runs (W&B offline next to TensorBoard, every rank's own metrics) are in
tests/e2e/test_metrics_sinks.py."""

from __future__ import annotations

import pytest

from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError


def test_wandb_missing_is_a_config_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a)
    )
    with pytest.raises(
        ConfigError, match="metrics.enable_wandb: the wandb package is not installed"
    ):
        parse_args(["--metrics.enable_wandb"])
