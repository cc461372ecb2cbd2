"""Loading checkpoints written before a parameter was fused: this library's checkpoints from
before the attention's ``wqkv`` hold ``wq``, ``wk`` and ``wv`` instead.

Where the model (or the optimizer's per-parameter state) asks for a fused entry that the
checkpoint lacks but whose separate parts it holds, the load reads the parts into full-size
temporaries and merges them afterwards with the family's rule (its state-dict adapter's
``merge_tensors``), then shards the result like the entry it replaces. Entries that are not
per-row tensors (the optimizer's step count, a parameter group's settings) are the same for every
part and are read from the first. No model family is imported: the adapter comes from the train
spec. Memory: every rank holds the full fused tensors of its entries while the load runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass
class _Merge:
    section: str  # "model" or "optimizer"
    key: str  # the entry as the model asks for it (in the fused layout)
    fqn: str  # the fused parameter it belongs to
    parts: list[str]  # the entries the checkpoint holds instead
    like: Any  # the entry's original value: its placements, dtype and device
    per_row: bool  # True: merge the parts' rows; False: take the first part's value


def _fused_fqn(key: str, fused: dict[str, tuple[str, ...]]) -> str | None:
    """The fused parameter a state entry belongs to (``layers.3.attention.wqkv.weight`` in
    ``state.layers.3.attention.wqkv.weight.exp_avg``), None if it belongs to none."""
    for name in fused:
        m = re.search(rf"(?:^|\.)(layers\.\d+\.{re.escape(name)})(?:$|\.)", key)
        if m:
            return m.group(1)
    return None


def plan_unfused_load(state: dict[str, Any], available: set[str], adapter: Any) -> list[_Merge]:
    """Rewrite ``state`` (``{"model": {...}, "optimizer": {...}, ...}``, what ``dcp.load`` fills)
    in place so that it asks for the separate parts where the checkpoint (flat keys
    ``available``) lacks a fused entry but holds its parts; the merges to do after the load."""
    if adapter is None or not getattr(adapter, "fused", None):
        return []
    merges = []
    for section in ("model", "optimizer"):
        entries = state.get(section)
        if not isinstance(entries, dict):
            continue
        for key in list(entries):
            fqn = _fused_fqn(key, adapter.fused)
            if fqn is None or f"{section}.{key}" in available:
                continue
            part_fqns = adapter.fused_parts(fqn)
            parts = [key.replace(fqn, p) for p in part_fqns]
            if not all(f"{section}.{p}" in available for p in parts):
                continue  # not an older layout: the usual missing-key error reports it
            value = entries.pop(key)
            per_row = isinstance(value, torch.Tensor) and value.ndim > 0
            if per_row:
                meta = torch.empty(value.shape, device="meta")
                for p, piece in zip(parts, adapter.split_tensor(fqn, meta)):
                    entries[p] = torch.empty(piece.shape, dtype=value.dtype)
            else:
                entries[parts[0]] = value.full_tensor() if isinstance(value, DTensor) else value
            merges.append(_Merge(section, key, fqn, parts, value, per_row))
    return merges


def apply_merges(state: dict[str, Any], merges: list[_Merge], adapter: Any) -> None:
    """After the load: each fused entry back in ``state``, merged from the parts read, sharded
    (and typed, and placed) like the entry it replaced."""
    for m in merges:
        entries = state[m.section]
        if not m.per_row:
            entries[m.key] = entries.pop(m.parts[0])
            continue
        full = adapter.merge_tensors(m.fqn, [entries.pop(p) for p in m.parts])
        like = m.like
        full = full.to(device=like.device, dtype=like.dtype)
        if isinstance(like, DTensor):
            full = distribute_tensor(full, like.device_mesh, like.placements)
        entries[m.key] = full
