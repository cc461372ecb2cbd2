"""The pretraining loss the families share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all positions, computed in float32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
