"""Gated DeltaNet (``models/common/gated_deltanet.py``): the chunked rule against the token-by-token
reference and against ``transformers``' own torch functions, document resets against running each
document alone, a sequence continued from its first part's state and convolution tail, and the
layer against ``transformers``' ``Qwen3NextGatedDeltaNet`` on the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.gated_deltanet import (
    GatedDeltaNet,
    causal_conv,
    document_starts,
    gated_delta_chunked,
    gated_delta_recurrent,
    l2_normalize,
)

B, H, DK, DV = 2, 3, 8, 6


def _inputs(t: int, seed: int = 0, heads: int = H) -> list[torch.Tensor]:
    """``q`` (normalized and scaled), ``k`` (normalized), ``v``, ``g`` (log-decays from about
    -0.01 to -5, so some chunks' cumulative decays underflow), ``beta`` in (0, 1), as leaves."""
    g_ = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, t, heads, DK, generator=g_)) * DK**-0.5
    k = l2_normalize(torch.randn(B, t, heads, DK, generator=g_))
    v = torch.randn(B, t, heads, DV, generator=g_)
    g = -F.softplus(torch.randn(B, t, heads, generator=g_) * 2 - 1)
    beta = torch.rand(B, t, heads, generator=g_)
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def _documents(t: int, starts: list[list[int]]) -> torch.Tensor:
    """Document ids ``[B, t]`` from each row's start positions (after 0)."""
    ids = torch.zeros(len(starts), t, dtype=torch.int64)
    for row, positions in enumerate(starts):
        for p in positions:
            ids[row, p:] += 1
    return ids


def _grads(
    out: torch.Tensor, state: torch.Tensor, leaves: list[torch.Tensor]
) -> list[torch.Tensor]:
    g_ = torch.Generator().manual_seed(7)
    loss = (out * torch.randn(out.shape, generator=g_)).sum() + (
        state * torch.randn(state.shape, generator=g_)
    ).sum()
    return list(torch.autograd.grad(loss, leaves))


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> None:
    for x, y in zip(a, b):
        assert (x - y).abs().max().item() <= tol * max(1.0, y.abs().max().item()), (
            (x - y).abs().max().item()
        )


@pytest.mark.parametrize("t, chunk", [(32, 8), (30, 8), (37, 16), (20, 64)])
@pytest.mark.parametrize("documents", [False, True])
def test_chunked_equals_recurrent_in_values_and_gradients(t, chunk, documents):
    """Chunk sizes that divide the length and that do not (the last chunk padded; one chunk
    longer than the sequence), with an incoming state, and with documents starting inside a
    chunk, on a chunk's first position and two positions apart."""
    leaves = _inputs(t)
    state = torch.randn(B, H, DK, DV, requires_grad=True)
    resets = None
    if documents:
        resets = document_starts(_documents(t, [[3, 8, 10], [t // 2]]))
    ref_out, ref_state = gated_delta_recurrent(*leaves, state=state, resets=resets)
    out, final = gated_delta_chunked(*leaves, chunk_size=chunk, state=state, resets=resets)
    _close([out, final], [ref_out, ref_state], 1e-5)
    _close(_grads(out, final, [*leaves, state]), _grads(ref_out, ref_state, [*leaves, state]), 1e-5)


def test_a_document_sees_nothing_of_the_one_before():
    """Each document of a packed row gives what it gives alone (outputs; the final state is the
    last document's)."""
    t, starts = 40, [[5, 21], [17]]
    doc_ids = _documents(t, starts)
    q, k, v, g, beta = (x.detach() for x in _inputs(t))
    out, final = gated_delta_chunked(
        q, k, v, g, beta, chunk_size=8, resets=document_starts(doc_ids)
    )
    for row, positions in enumerate(starts):
        bounds = [0, *positions, t]
        for lo, hi in zip(bounds, bounds[1:]):
            alone, state = gated_delta_chunked(
                *(x[row : row + 1, lo:hi] for x in (q, k, v, g, beta)), chunk_size=8
            )
            assert torch.allclose(out[row : row + 1, lo:hi], alone, atol=1e-6)
        assert torch.allclose(final[row], state[0], atol=1e-6)


def test_a_sequence_continues_from_its_first_parts_state_and_convolution_tail():
    """What context parallel builds on: the second part of a sequence, given the first part's
    final state (and the last K - 1 inputs of the convolution), computes what the whole
    sequence computes there, across a document boundary too."""
    t, cut, kernel = 48, 20, 4
    leaves = [x.detach() for x in _inputs(t)]
    doc_ids = _documents(t, [[14, 26], [cut]])
    resets = document_starts(doc_ids)
    whole, whole_state = gated_delta_chunked(*leaves, chunk_size=8, resets=resets)
    first = [x[:, :cut] for x in leaves]
    _, state = gated_delta_chunked(*first, chunk_size=8, resets=resets[:, :cut])
    second, end = gated_delta_chunked(
        *(x[:, cut:] for x in leaves), chunk_size=8, state=state, resets=resets[:, cut:]
    )
    assert torch.allclose(second, whole[:, cut:], atol=1e-6)
    assert torch.allclose(end, whole_state, atol=1e-6)

    x, weight = torch.randn(B, t, 5), torch.randn(5, kernel)
    full = causal_conv(x, weight, doc_ids)
    rest = causal_conv(
        x[:, cut:],
        weight,
        doc_ids[:, cut:],
        tail=x[:, cut - kernel + 1 : cut],
        tail_doc_ids=doc_ids[:, cut - kernel + 1 : cut],
    )
    assert torch.allclose(rest, full[:, cut:], atol=1e-6)


def test_causal_conv_is_conv1d_and_stops_at_document_starts():
    t, channels, kernel = 12, 5, 4
    x, weight = torch.randn(B, t, channels), torch.randn(channels, kernel)
    conv = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), padding=kernel - 1, groups=channels)
    assert torch.allclose(causal_conv(x, weight), conv[..., :t].transpose(1, 2), atol=1e-6)
    doc_ids = _documents(t, [[4], [6, 7]])
    out = causal_conv(x, weight, doc_ids)
    for row, positions in enumerate([[4], [6, 7]]):
        bounds = [0, *positions, t]
        for lo, hi in zip(bounds, bounds[1:]):
            alone = causal_conv(x[row : row + 1, lo:hi], weight)
            assert torch.allclose(out[row : row + 1, lo:hi], alone, atol=1e-6)


def test_the_rule_matches_transformers_torch_functions():
    """``transformers``' ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule``
    (they normalize and scale the queries and keys themselves; 4 value heads over 2 key heads)."""
    tq = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    t, heads = 37, 4
    g_ = torch.Generator().manual_seed(3)
    q, k = (torch.randn(B, t, 2, DK, generator=g_) for _ in range(2))
    v = torch.randn(B, t, heads, DV, generator=g_)
    g = -F.softplus(torch.randn(B, t, heads, generator=g_))
    beta = torch.rand(B, t, heads, generator=g_)
    state = torch.randn(B, heads, DK, DV, generator=g_)
    ours_q = (l2_normalize(q) * DK**-0.5).repeat_interleave(2, dim=2)
    ours_k = l2_normalize(k).repeat_interleave(2, dim=2)
    out, final = gated_delta_chunked(ours_q, ours_k, v, g, beta, chunk_size=16, state=state)
    for fn, extra in (
        (tq.torch_chunk_gated_delta_rule, {"chunk_size": 16}),
        (tq.torch_recurrent_gated_delta_rule, {}),
    ):
        theirs, their_state = fn(
            q,
            k,
            v,
            g=g,
            beta=beta,
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            **extra,
        )
        assert torch.allclose(out, theirs, atol=1e-5), (out - theirs).abs().max()
        assert torch.allclose(final, their_state, atol=1e-5)


def _tiny_hf_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        hidden_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )


def _load_from_hf(ours: GatedDeltaNet, hf: torch.nn.Module, cfg) -> None:
    """``transformers``' weights into ours: the same names and layouts, but the convolution's
    channels (all queries, all keys, all values) regrouped by key head."""
    g, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    r_dv = cfg.linear_num_value_heads // g * cfg.linear_value_head_dim
    conv = hf.conv1d.weight.squeeze(1)  # [G Dk + G Dk + G r Dv, K]
    q, k, v = conv.split((g * dk, g * dk, g * r_dv))
    grouped = torch.cat([q.view(g, dk, -1), k.view(g, dk, -1), v.view(g, r_dv, -1)], dim=1)
    state = {n: p for n, p in hf.state_dict().items() if n != "conv1d.weight"}
    ours.load_state_dict({**state, "conv_weight": grouped.flatten(0, 1)})


@pytest.mark.parametrize("t", [9, 70])
def test_the_layer_matches_transformers_qwen3_next_gated_deltanet(t):
    """Output and input gradient of the whole layer, one chunk and more than one (chunk 64)."""
    pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    cfg = _tiny_hf_config()
    torch.manual_seed(0)
    hf = Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.3)  # away from init: the norm and gates matter
    ours = GatedDeltaNet(32, 2, 4, 8, 6, conv_kernel=4, norm_eps=1e-6)
    _load_from_hf(ours, hf, cfg)
    x = torch.randn(2, t, 32)
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    theirs, mine = hf(x_hf), ours(x_ours)
    assert torch.allclose(mine, theirs, atol=1e-5), (mine - theirs).abs().max()
    dy = torch.randn_like(theirs)
    theirs.backward(dy)
    mine.backward(dy)
    err = (x_ours.grad - x_hf.grad).abs().max() / x_hf.grad.abs().max()
    assert err < 1e-5, err
