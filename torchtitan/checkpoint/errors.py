"""The checkpoint package's error (its own module: every other module of the package raises it)."""

from __future__ import annotations

from torchtitan.errors import TorchTitanError


class CheckpointError(TorchTitanError):
    """A checkpoint that cannot be used: missing, incomplete, damaged or of another model."""

    exit_code = 1
