"""Requests encoded, laid out in rows and scored as lm-eval does it."""

from __future__ import annotations

import pytest
import torch
from repo_paths import TIKTOKEN_PATH

from torchtitan.data.batch import IGNORE_INDEX
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.evaluation.scoring import choice_scores, encode_pair, request_rows
from torchtitan.evaluation.tasks import Doc


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(str(TIKTOKEN_PATH))


def test_the_continuation_is_what_the_whole_text_has_after_the_context(tok):
    """A trailing space moves to the continuation, and the continuation's tokens come from the
    whole text's encoding (where the context's last word and the continuation may merge)."""
    ctx, cont = encode_pair(tok, "Answer: ", "def", add_bos=True)
    assert ctx == tok.encode("Answer:", bos=True, eos=False)
    whole = tok.encode("Answer: def", bos=True, eos=False)
    assert ctx + cont == whole
    ctx, cont = encode_pair(tok, "Answer:", " def", add_bos=False)
    assert ctx + cont == tok.encode("Answer: def", bos=False, eos=False)
    assert ctx == tok.encode("Answer:", bos=False, eos=False)


def test_an_empty_context_is_the_bos_token(tok):
    ctx, cont = encode_pair(tok, "", " def", add_bos=True)
    assert ctx == [tok.bos_id] and cont == tok.encode(" def", bos=False, eos=False)


def test_rows_keep_the_end_and_label_only_the_continuation():
    rows = request_rows([([1, 2, 3], [4, 5]), ([9] * 10, [7]), ([], [])], seq_len=6, pad_id=0)
    assert rows.inputs[0].tolist() == [1, 2, 3, 4, 0, 0]
    assert rows.labels[0].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 4, 5, IGNORE_INDEX, IGNORE_INDEX]
    assert rows.inputs[1].tolist() == [9] * 6  # the last 7 tokens: the model reads 6
    assert rows.labels[1].tolist() == [IGNORE_INDEX] * 5 + [7]
    assert (rows.labels[2] == IGNORE_INDEX).all()  # an empty row scores nothing
    assert rows.doc_ids.shape == rows.inputs.shape and not rows.doc_ids.any()


def test_scores_are_lm_evals_argmax_and_per_character_norm():
    doc = Doc(requests=(("q", " a"),) * 3, choices=("a", "bbbb", "cc"), gold=1)
    scores = choice_scores(doc, [-2.0, -4.0, -3.0])
    assert scores["pred"] == 0 and scores["acc"] == 0.0  # the highest sum
    assert scores["pred_norm"] == 1 and scores["acc_norm"] == 1.0  # -1.0 per character
    tie = choice_scores(doc, [-1.0, -1.0, -1.0])
    assert tie["pred"] == 0  # the first of equal ones, as numpy.argmax
    assert torch.tensor([-1.0, -1.0]).argmax().item() == 0


def test_a_context_of_spaces_alone_is_an_empty_context(tok):
    ctx, cont = encode_pair(tok, "  ", "def", add_bos=False)
    assert ctx == [tok.bos_id] and cont == tok.encode("  def", bos=False, eos=False)
