"""Distributed checkpoints: save (sync or async), load with fall-back, Hugging Face exchange."""

from torchtitan.checkpoint.manager import CheckpointError, CheckpointManager, TrainState

__all__ = ["CheckpointError", "CheckpointManager", "TrainState"]
