"""Requests as token rows, and documents scored as lm-evaluation-harness scores them.

* **Encoding** (:func:`encode_pair`, lm-eval's ``TemplateLM._encode_pair`` and ``loglikelihood``):
  trailing whitespace of the context moves to the continuation; the context and the whole text
  are encoded (each starting with BOS where the tokenizer's export adds it: ``add_bos``), and the
  continuation's tokens are what the whole text has after the context's. An empty context is
  the BOS token (EOS without one).
* **Rows** (:func:`request_rows`, lm-eval's ``HFLM._loglikelihood_tokens``): context and
  continuation, cut to their last ``seq_len + 1`` tokens; the model reads all but the last, and
  only the continuation's positions are labelled, so a row's summed loss is minus the
  continuation's log-likelihood. Rows are padded to ``seq_len`` (no label there).
* **Scores** (:func:`choice_scores`, lm-eval's ``ConfigurableTask.process_results`` for
  ``multiple_choice``): the prediction is the choice of the highest summed log-likelihood (the
  first of equal ones, as ``numpy.argmax``); ``acc`` compares it to the gold index, ``acc_norm``
  the one of the highest log-likelihood per character of the choice (``len`` of its text, as
  lm-eval divides; lm-eval calls per-byte ``acc_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from torchtitan.data.batch import IGNORE_INDEX, Batch
from torchtitan.evaluation.tasks import Doc

__all__ = ["choice_scores", "encode_pair", "request_rows"]


def encode_pair(
    tokenizer: Any, context: str, continuation: str, add_bos: bool
) -> tuple[list[int], list[int]]:
    """``(context ids, continuation ids)`` as lm-eval encodes a causal model's request (a
    context of spaces alone counts as empty, its spaces moved to the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    if not context:
        cont = tokenizer.encode(continuation, bos=False, eos=False)
        bos = tokenizer.bos_id
        prefix = bos if bos is not None and bos >= 0 else tokenizer.eos_id
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    whole = tokenizer.encode(context + continuation, bos=add_bos, eos=False)
    ctx = tokenizer.encode(context, bos=add_bos, eos=False)
    return ctx, whole[len(ctx) :]


def request_rows(
    pairs: Sequence[tuple[list[int], list[int]]], seq_len: int, pad_id: int = 0
) -> Batch:
    """A batch of one row per ``(context ids, continuation ids)``: its last ``seq_len + 1``
    tokens, the continuation's positions labelled, padded to ``seq_len``."""
    inputs = torch.full((len(pairs), seq_len), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), seq_len), IGNORE_INDEX, dtype=torch.long)
    for row, (ctx, cont) in enumerate(pairs):
        if not cont:
            continue  # nothing to score (an empty choice): log-likelihood 0, as lm-eval's
        tokens = (list(ctx) + list(cont))[-(seq_len + 1) :]
        n_in, n_cont = len(tokens) - 1, min(len(cont), seq_len)
        inputs[row, :n_in] = torch.tensor(tokens[:-1])
        labels[row, n_in - n_cont : n_in] = torch.tensor(tokens[-n_cont:])
    doc_ids = torch.zeros(inputs.shape, dtype=torch.int32)
    return Batch(inputs, labels, doc_ids)


def choice_scores(doc: Doc, lls: Sequence[float]) -> dict[str, Any]:
    """``acc``, ``acc_norm`` and the predictions of one document from its choices' summed
    log-likelihoods."""
    pred = _argmax(lls)
    pred_norm = _argmax([ll / max(len(c), 1) for ll, c in zip(lls, doc.choices)])
    return {
        "acc": float(pred == doc.gold),
        "acc_norm": float(pred_norm == doc.gold),
        "pred": pred,
        "pred_norm": pred_norm,
    }


def _argmax(values: Sequence[float]) -> int:
    """The index of the first largest value (``numpy.argmax``)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))
