"""What the data loader yields: packed token rows and where their documents start.

A row packs documents back to back into ``seq_len + 1`` window tokens; ``inputs = window[:-1]``,
``labels = window[1:]``. ``doc_ids[b, t]`` numbers the documents of row ``b`` as seen from input
position ``t``: 0 at position 0 (whether a document starts there or the row began inside one),
plus one at every later position where a document starts. Attention with
``model.attn_mask_type = "block_causal"`` lets position ``t`` see position ``s <= t`` only when
``doc_ids[b, s] == doc_ids[b, t]``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

IGNORE_INDEX = -100  # a label that counts in neither the loss nor its token count


class Batch(NamedTuple):
    """``inputs`` and ``labels`` ``[n, seq_len]`` int64 (labels equal to ``IGNORE_INDEX`` are not
    predicted); ``doc_ids`` ``[n, seq_len]`` int32 (see the module docstring)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor


def make_batch(windows: torch.Tensor, starts: np.ndarray, mask_document_starts: bool) -> Batch:
    """The batch of ``windows [n, seq_len + 1]`` int64 whose documents start where ``starts
    [n, seq_len + 1]`` (bool) is true. With ``mask_document_starts`` the first token of each
    document is not predicted from the end of the one before (its label is ``IGNORE_INDEX``)."""
    new_doc = torch.from_numpy(np.ascontiguousarray(starts[:, 1:], dtype=bool))
    doc_ids = torch.zeros(new_doc.shape, dtype=torch.int32)
    doc_ids[:, 1:] = new_doc[:, :-1].cumsum(1, dtype=torch.int32)
    inputs = windows[:, :-1].contiguous()
    if mask_document_starts:
        # a copy: with one row, ``.contiguous()`` of the slice is a view of ``windows`` (and so of
        # ``inputs``), which the masking would overwrite
        labels = windows[:, 1:].clone(memory_format=torch.contiguous_format)
        labels[new_doc] = IGNORE_INDEX
    else:
        labels = windows[:, 1:].contiguous()
    return Batch(inputs, labels, doc_ids)
