"""Training data: tokenizers, sources, packing into sequences, and the stateful loader.

``build_hf_dataloader`` (:mod:`torchtitan.data.loader`) is imported on first use, so that
importing a light submodule (``pydoc_corpus``, ``tokenizer``) does not import torch: the data
loader benchmark pins its process to one core before torch starts any thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchtitan.data.loader import build_hf_dataloader

__all__ = ["build_hf_dataloader"]


def __getattr__(name: str) -> Any:
    if name == "build_hf_dataloader":
        from torchtitan.data.loader import build_hf_dataloader

        globals()[name] = build_hf_dataloader
        return build_hf_dataloader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
