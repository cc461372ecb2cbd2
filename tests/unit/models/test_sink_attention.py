"""Attention sinks and sliding windows (torchtitan/models/common/attention.py) against
``transformers``' gpt-oss attention and mask, and against the formula written out here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchtitan.models.common.attention import (
    CausalAttention,
    document_mask,
    sink_attention,
    sliding_window_mask,
)

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


# ---- the training kernels (torchtitan/models/common/sink_window.py) against the oracle above

T_ODD = 13  # not a multiple of the windows below: the last chunk is partial


def _leaves(dtype=torch.float64, seed=1):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, T_ODD, D), (B, H_KV, T_ODD, D), (B, H_KV, T_ODD, D), (H,)]
    return [torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _allowed(window, documents):
    causal = torch.ones(T_ODD, T_ODD, dtype=torch.bool).tril()
    allowed = causal if window is None else causal & sliding_window_mask(T_ODD, window)
    doc_mask = document_mask(DOCS) if documents else None
    return (allowed if doc_mask is None else doc_mask & allowed), doc_mask


DOCS = torch.tensor([[0] * 6 + [1] * 7, [0] * 2 + [1] * 9 + [2] * 2])


@pytest.mark.parametrize("window", [None, 1, 4, 5, 13, 40])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no_sinks"])
def test_the_fused_kernel_has_the_oracles_values_and_gradients(window, documents, with_sinks):
    """SDPA with the sink folded in as a key and the window banded into chunks: outputs and the
    gradients of q, k, v and the sinks equal the written-out scores' (float64)."""
    q, k, v, sinks = _leaves()
    allowed, doc_mask = _allowed(window, documents)
    # no sinks is a sink far below every score (the oracle needs one)
    oracle_sinks = sinks if with_sinks else torch.full((H,), -1e4, dtype=torch.float64)
    ref = sink_attention(q, k, v, oracle_sinks, allowed, scale=0.4)
    got = CausalAttention()(
        q, k, v, doc_mask, scale=0.4, sinks=sinks if with_sinks else None, window=window
    )
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    weights = torch.randn_like(ref)
    leaves = (q, k, v, sinks) if with_sinks else (q, k, v)
    want = torch.autograd.grad((ref * weights).sum(), leaves)
    got_grads = torch.autograd.grad((got * weights).sum(), leaves)
    for name, g, w in zip("qkvS", got_grads, want, strict=False):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize(
    "window, documents", [(None, False), (4, False), (4, True)], ids=["causal", "window", "both"]
)
def test_the_fused_kernel_in_float32_and_bfloat16_stays_near_the_float64_oracle(window, documents):
    """In float32 and bfloat16 the fused kernels run (CPU's flash attention where it takes the
    shapes: all of q, k and v one width), not the float64 math the test above checks."""
    q, k, v, sinks = _leaves()
    allowed, doc_mask = _allowed(window, documents)
    ref = sink_attention(q, k, v, sinks, allowed)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        low = [x.detach().to(dtype) for x in (q, k, v, sinks)]
        got = CausalAttention()(*low[:3], doc_mask, sinks=low[3], window=window)
        assert got.dtype == dtype
        assert (got.double() - ref).abs().max() < tol, dtype


def test_without_sinks_a_partial_last_window_chunk_has_the_oracles_gradients():
    """Documents, a window that does not divide the sequence, no sinks, float32: values and
    finite q/k/v gradients as the oracle's. (The padded queries of the last chunk are made to
    see themselves: a fused kernel may give an empty row NaN, which would reach the keys'
    gradients through a zero; CPU's gives zeros, so this passes without that too.)"""
    q, k, v, _ = (x.detach().float().requires_grad_() for x in _leaves())
    allowed, doc_mask = _allowed(4, True)
    far = torch.full((H,), -1e4)
    ref = sink_attention(q, k, v, far, allowed)
    got = CausalAttention()(q, k, v, doc_mask, window=4)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(got.sum(), (q, k, v))
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for g, w in zip(grads, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [None, 4])
def test_the_flex_path_rescales_by_the_log_sum_exp_to_the_oracles_numbers(window):
    """The CUDA path's math (FlexAttention and its log-sum-exp, ``o * sigmoid(lse - S)``), run
    by torch's unfused reference here (forward only on CPU)."""
    from torchtitan.models.common.attention import document_block_mask, windowed_block_mask
    from torchtitan.models.common.sink_window import flex_sink_window

    q, k, v, sinks = (x.detach().float() for x in _leaves())
    allowed, _ = _allowed(window, True)
    block_mask = document_block_mask(DOCS, compile_mask=False)
    if window is not None:
        block_mask = windowed_block_mask(block_mask, window)
        assert windowed_block_mask(document_block_mask(DOCS, False), window) is not block_mask
    got = flex_sink_window(q, k, v, block_mask, sinks, compiled=False)
    torch.testing.assert_close(got, sink_attention(q, k, v, sinks, allowed), rtol=0, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 128])
@pytest.mark.parametrize("documents", [False, True], ids=["causal", "documents"])
def test_on_cuda_the_kernels_match_the_cpu_path(window, documents):
    """CUDA (compiled FlexAttention under a block mask for documents; SDPA banded otherwise)
    against the CPU path in float64: outputs and every gradient, in float32."""
    g = torch.Generator().manual_seed(0)
    b, h, h_kv, t, d = 2, 8, 2, 512, 64
    leaves = [torch.randn(*s, generator=g) for s in ((b, h, t, d), (b, h_kv, t, d))]
    leaves = [leaves[0], leaves[1], torch.randn(b, h_kv, t, d, generator=g), torch.randn(h)]
    doc_ids = torch.tensor([[0] * 200 + [1] * 312, [0] * 512])
    dout = torch.randn(b, h, t, d, generator=g)

    def run(device, dtype):
        xs = [x.to(device, dtype).requires_grad_() for x in leaves]
        kernel = CausalAttention()
        mask = kernel.mask_for(doc_ids.to(device)) if documents else None
        out = kernel(*xs[:3], mask, sinks=xs[3], window=window)
        out.backward(dout.to(device, dtype))
        return [out.double().cpu()] + [x.grad.double().cpu() for x in xs]

    for got, want in zip(run("cuda", torch.float32), run("cpu", torch.float64), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)


def test_yarn_without_truncation_is_transformers_gpt_oss_rope():
    """gpt-oss's YaRN (``truncate: false``: the ramp from pair 8.09 to 17.40, not 8 to 18) and its
    attention factor, against ``transformers``' own for the published rope parameters."""
    pytest.importorskip("transformers")
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from torchtitan.models.common.rope import yarn_inv_freqs, yarn_mscale

    config = GptOssConfig(head_dim=64)
    assert config.rope_parameters["truncate"] is False
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = yarn_inv_freqs(64, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-6, atol=0)
    assert yarn_mscale(32.0) == pytest.approx(factor, rel=1e-12)
    truncated = yarn_inv_freqs(64, 150000.0, 32.0, 4096, beta_fast=32.0, beta_slow=1.0)
    assert not torch.allclose(truncated.float(), theirs.float(), rtol=1e-3)


def test_grouped_query_attention_with_biases_sinks_and_a_window_is_the_written_out_layer():
    """The attention layer gpt-oss builds from ``GroupedQueryAttention``'s options: biased
    projections, rotary, the sink and window kernel, the biased output projection."""
    from torchtitan.models.common import rope
    from torchtitan.models.common.blocks import GroupedQueryAttention, split_qkv

    torch.manual_seed(0)
    dim, t = 16, 11
    layer = GroupedQueryAttention(
        dim, H, H_KV, D, rope.apply_half_split, bias=True, sinks=True, window=4, scale=0.3
    ).double()
    layer.init_weights(0.02)
    assert layer.sinks.abs().min() > 0 and not layer.wo.bias.any()
    with torch.no_grad():  # biases that bite
        layer.wqkv.bias.normal_(), layer.wo.bias.normal_()
    table = rope.half_split_table(rope.angles(rope.inv_freqs(D, 10000.0), t)).double()
    x = torch.randn(2, t, dim, dtype=torch.float64)
    wq, wk, wv = split_qkv(layer.wqkv.weight, H, H_KV)
    bq, bk, bv = split_qkv(layer.wqkv.bias, H, H_KV)
    q, k, v = ((x @ w.T + b).unflatten(-1, (-1, D)) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    q, k = rope.apply_half_split(q, k, table)
    mask = sliding_window_mask(t, 4)
    out = sink_attention(*(z.transpose(1, 2) for z in (q, k, v)), layer.sinks, mask, scale=0.3)
    want = layer.wo(out.transpose(1, 2).flatten(2))
    torch.testing.assert_close(layer(x, table), want, rtol=1e-10, atol=1e-12)
