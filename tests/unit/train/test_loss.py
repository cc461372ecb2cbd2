"""The loss the families share, whole and in pieces of the sequence with the output projection
(``training.loss_chunks``): the same value and the same gradients as the whole-batch loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.train.loss import IGNORE_INDEX, ChunkedOutputLoss, cross_entropy_loss


def _whole_and_pieces(n_chunks: int, labels: torch.Tensor, hidden: torch.Tensor):
    output = nn.Linear(hidden.shape[-1], 50, bias=False)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    whole = cross_entropy_loss(output(h1), labels)
    whole.backward()
    grads = (h1.grad, output.weight.grad.clone())
    output.weight.grad = None
    pieces = ChunkedOutputLoss(output, n_chunks)(h2, labels)
    pieces.backward()
    return whole, pieces, grads, (h2.grad, output.weight.grad)


@pytest.mark.parametrize("n_chunks", [1, 3, 4, 64])  # uneven, even, more pieces than positions
def test_pieces_give_the_whole_batch_loss_and_gradients(n_chunks):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 10, 16, generator=gen)
    labels = torch.randint(0, 50, (2, 10), generator=gen)
    whole, pieces, g_whole, g_pieces = _whole_and_pieces(n_chunks, labels, hidden)
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_pieces, g_whole):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_ignored_labels_count_in_neither_sum_nor_mean():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 8, 16, generator=gen)
    labels = torch.randint(0, 50, (2, 8), generator=gen)
    labels[0, :5] = IGNORE_INDEX  # the whole first piece of row 0 and part of the second
    whole, pieces, g_whole, g_pieces = _whole_and_pieces(4, labels, hidden)
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g_pieces[0], g_whole[0], rtol=1e-5, atol=1e-7)
    assert g_pieces[0][0, :5].abs().max() == 0  # no gradient from ignored positions


def test_model_stops_at_the_final_norm_when_the_loss_projects():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=40, max_seq_len=12)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 40, (2, 12))
    labels = torch.randint(0, 40, (2, 12))
    whole = cross_entropy_loss(model(tokens), labels)
    model.output_in_loss = True
    hidden = model(tokens)
    assert hidden.shape == (2, 12, 32)
    torch.testing.assert_close(ChunkedOutputLoss(model.output, 5)(hidden, labels), whole)


def test_no_pieces_is_refused():
    with pytest.raises(ValueError, match="n_chunks: 0 must be >= 1"):
        ChunkedOutputLoss(nn.Linear(4, 4), 0)
