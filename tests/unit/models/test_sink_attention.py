"""Attention sinks and sliding windows (torchtitan/models/common/attention.py) against
``transformers``' gpt-oss attention and mask, and against the formula written out here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import document_mask, sink_attention, sliding_window_mask

B, H, H_KV, T, D = 2, 4, 2, 12, 8


def _qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H_KV, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, H_KV, T, D, generator=g, dtype=dtype)
    sinks = torch.randn(H, generator=g, dtype=dtype) * 2
    return q, k, v, sinks


def _formula(q, k, v, sinks, mask, scale):
    """Row by row: p_ij = exp(s_ij) / (exp(S_h) + sum_j' exp(s_ij')) over the allowed keys."""
    out = torch.zeros_like(q)
    groups = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        for h in range(q.shape[1]):
            for i in range(q.shape[2]):
                keys = [j for j in range(q.shape[2]) if mask[i, j]]
                s = torch.stack([q[b, h, i] @ k[b, h // groups, j] * scale for j in keys])
                denom = torch.exp(sinks[h]) + torch.exp(s).sum()
                p = torch.exp(s) / denom
                out[b, h, i] = sum(p[n] * v[b, h // groups, j] for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("window", [None, 4])
def test_equals_transformers_gpt_oss_attention(window):
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    q, k, v, sinks = _qkv(torch.float32)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    if window is not None:
        mask = sliding_window_mask(T, window)
    holder = nn.Module()  # what eager_attention_forward reads: the sinks and the kv groups
    holder.sinks, holder.num_key_value_groups = nn.Parameter(sinks), H // H_KV
    additive = torch.zeros(T, T).masked_fill(~mask, float("-inf")).expand(B, 1, T, T)
    theirs, _ = modeling.eager_attention_forward(holder, q, k, v, additive, D**-0.5)
    ours = sink_attention(q, k, v, sinks, mask)
    torch.testing.assert_close(ours.transpose(1, 2), theirs, rtol=1e-5, atol=1e-6)


def test_values_and_gradients_follow_the_formula():
    q, k, v, sinks = (t.requires_grad_() for t in _qkv())
    mask = sliding_window_mask(T, 5)
    ours = sink_attention(q, k, v, sinks, mask, scale=0.3)
    ref = _formula(q, k, v, sinks, mask, 0.3)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(ours)
    got = torch.autograd.grad((ours * weights).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * weights).sum(), (q, k, v, sinks))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11)
    assert got[3].abs().min() > 0  # every head's sink is trained


def test_a_sink_far_below_the_logits_is_plain_attention_and_the_closed_form_holds():
    q, k, v, sinks = _qkv()
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    far = torch.full((H,), -1e4, dtype=torch.float64)
    torch.testing.assert_close(sink_attention(q, k, v, far), plain)
    # o = o_std * sigmoid(lse - S): the rescaling a fused kernel applies
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    logits = (q @ k.repeat_interleave(2, 1).transpose(-2, -1)) / math.sqrt(D)
    lse = logits.masked_fill(~causal, float("-inf")).logsumexp(-1, keepdim=True)
    rescaled = plain * torch.sigmoid(lse - sinks.reshape(1, H, 1, 1))
    torch.testing.assert_close(sink_attention(q, k, v, sinks), rescaled)
    assert not torch.allclose(rescaled, plain)


@pytest.mark.parametrize("window", [1, 3, 128])
def test_the_window_holds_window_keys_itself_included_as_transformers_masks(window):
    utils = pytest.importorskip("transformers.masking_utils")
    t = 20
    mask = sliding_window_mask(t, window)
    theirs = utils.sliding_window_causal_mask_function(window)
    pos = torch.arange(t)
    expected = theirs(torch.tensor(0), torch.tensor(0), pos.unsqueeze(1), pos.unsqueeze(0))
    assert torch.equal(mask, expected)
    assert mask.sum(1).tolist() == [min(i + 1, window) for i in range(t)]


def test_a_window_within_documents_is_the_and_of_both_masks():
    doc_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    both = document_mask(doc_ids) & sliding_window_mask(10, 3)
    assert both[0, 0, 5].tolist() == [False] * 4 + [True, True] + [False] * 4
    assert both[0, 0, 9].tolist() == [False] * 7 + [True] * 3
    q, k, v, sinks = _qkv()
    q, k, v = (t[:1, :, :10] for t in (q, k, v))
    ref = _formula(q, k, v, sinks, both[0, 0], D**-0.5)
    torch.testing.assert_close(sink_attention(q, k, v, sinks, both), ref)
