"""Distributed checkpoints: save (sync or async), load with fall-back, Hugging Face exchange.

Modules: ``manager`` (CheckpointManager), ``folder`` (step folders, the COMPLETE marker, the
choices of what to load, set aside and purge), ``states`` (what is saved), ``safe_read`` (safe
unpickling, ``read_model_weights``), ``collectives`` (ranks agreeing on errors), ``hf_exchange``
(Hugging Face load and export of a job), ``hf_files`` (Hugging Face folder I/O), ``errors``,
``save_failure`` (what a failed save says)."""

from torchtitan.checkpoint.errors import CheckpointError
from torchtitan.checkpoint.folder import MARKER, scan
from torchtitan.checkpoint.hf_exchange import hf_load_source
from torchtitan.checkpoint.manager import CheckpointManager
from torchtitan.checkpoint.safe_read import read_model_weights
from torchtitan.checkpoint.states import TrainState

__all__ = [
    "MARKER",
    "CheckpointError",
    "CheckpointManager",
    "TrainState",
    "hf_load_source",
    "read_model_weights",
    "scan",
]
