"""Checkpoints as earlier versions of this library wrote them, made from today's.

Before the attention's fused ``wqkv`` projection, checkpoints held ``wq``, ``wk`` and ``wv``
separately (model weights and the optimizer's per-parameter state alike). :func:`unfuse_qkv`
rewrites a DCP checkpoint folder into that layout, in place, with DCP's own format converters.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from torchtitan.models.common.blocks import split_qkv

_FUSED = re.compile(r"attention\.wqkv\.weight")


def _unfuse_entries(entries: dict[str, Any], n_heads: int, n_kv_heads: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in entries.items():
        if not _FUSED.search(key):
            out[key] = value
            continue
        names = [_FUSED.sub(f"attention.{w}.weight", key) for w in ("wq", "wk", "wv")]
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            out.update(zip(names, split_qkv(value, n_heads, n_kv_heads)))
        else:  # a step count or a parameter group's setting: the same for every part
            out.update(dict.fromkeys(names, value))
    return out


def unfuse_qkv(folder: Path, n_heads: int, n_kv_heads: int) -> None:
    """Rewrite the DCP checkpoint ``folder`` (its marker file kept) in the layout before
    ``wqkv``."""
    with tempfile.TemporaryDirectory() as tmp:
        flat = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(str(folder), flat)
        state = torch.load(flat, weights_only=False)
        for section in ("model", "optimizer"):
            state[section] = _unfuse_entries(state[section], n_heads, n_kv_heads)
        torch.save(state, flat)
        for f in folder.iterdir():
            if f.name == ".metadata" or f.suffix == ".distcp":
                f.unlink()
        torch_save_to_dcp(flat, str(folder))
