"""Optimizer construction: AdamW / Adam with a fused, foreach or for-loop implementation."""

from __future__ import annotations

import torch
import torch.nn as nn

from torchtitan.config_manager import Optimizer as OptimizerConfig
from torchtitan.log import logger


def _fused_supported(params: list[torch.Tensor]) -> bool:
    # Fused Adam(W) kernels exist for CUDA and (since torch 2.4) CPU; DTensor parameters work too.
    device_types = {p.device.type for p in params}
    return device_types <= {"cuda", "cpu", "xpu", "mps"}


def build_optimizer(model_parts: list[nn.Module], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """One optimizer over the trainable parameters of all model parts."""
    params = [p for m in model_parts for p in m.parameters() if p.requires_grad]
    impl = cfg.implementation
    if impl == "fused" and not _fused_supported(params):
        logger.info("optimizer.implementation: fused is not supported here; using foreach")
        impl = "foreach"
    kwargs = {
        "lr": cfg.lr,
        "betas": (cfg.beta1, cfg.beta2),
        "eps": cfg.eps,
        "weight_decay": cfg.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[cfg.name]
    return cls(params, **kwargs)
