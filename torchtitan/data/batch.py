"""What the data loader yields: packed token rows and where their documents start.

A row packs documents back to back into ``seq_len + 1`` window tokens; ``inputs = window[:-1]``,
``labels = window[1:]``. ``doc_ids[b, t]`` numbers the documents of row ``b`` as seen from input
position ``t``: 0 at position 0 (whether a document starts there or the row began inside one),
plus one at every later position where a document starts. Attention with
``model.attn_mask_type = "block_causal"`` lets position ``t`` see position ``s <= t`` only when
``doc_ids[b, s] == doc_ids[b, t]``.

Each window position carries marks (uint8 bits, or a bool array meaning :data:`DOC_START` only):
:data:`DOC_START` where a document starts, :data:`NOT_PREDICTED` on a token that is not a target
(the prompt side of a conversation); the label that is such a token is ``IGNORE_INDEX``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

IGNORE_INDEX = -100  # a label that counts in neither the loss nor its token count
DOC_START = 1  # a window position's mark: a document starts here
NOT_PREDICTED = 2  # a window position's mark: this token is not a target


class Batch(NamedTuple):
    """``inputs`` and ``labels`` ``[n, seq_len]`` int64 (labels equal to ``IGNORE_INDEX`` are not
    predicted); ``doc_ids`` ``[n, seq_len]`` int32 (see the module docstring)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    doc_ids: torch.Tensor


def make_batch(windows: torch.Tensor, marks: np.ndarray, mask_document_starts: bool) -> Batch:
    """The batch of ``windows [n, seq_len + 1]`` int64 with ``marks [n, seq_len + 1]`` (see the
    module docstring). With ``mask_document_starts`` the first token of each document is not
    predicted from the end of the one before (its label is ``IGNORE_INDEX``)."""
    marks = np.asarray(marks)
    if marks.dtype == bool:
        marks = marks.astype(np.uint8)  # DOC_START is 1
    label_marks = marks[:, 1:]
    new_doc = torch.from_numpy((label_marks & DOC_START).astype(bool))
    doc_ids = torch.zeros(new_doc.shape, dtype=torch.int32)
    doc_ids[:, 1:] = new_doc[:, :-1].cumsum(1, dtype=torch.int32)
    inputs = windows[:, :-1].contiguous()
    ignored = torch.from_numpy((label_marks & NOT_PREDICTED).astype(bool))
    if mask_document_starts:
        ignored |= new_doc
    if ignored.any():
        # a copy: with one row, ``.contiguous()`` of the slice is a view of ``windows`` (and so of
        # ``inputs``), which the masking would overwrite
        labels = windows[:, 1:].clone(memory_format=torch.contiguous_format)
        labels[ignored] = IGNORE_INDEX
    else:
        labels = windows[:, 1:].contiguous()
    return Batch(inputs, labels, doc_ids)
