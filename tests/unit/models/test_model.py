"""Llama model math and flavors: published sizes, training sanity, causality, GQA, RoPE, init."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models.common.blocks import fuse_qkv, split_qkv
from torchtitan.models.llama.flavors import llama2_configs, llama3_configs
from torchtitan.models.llama.model import (
    Attention,
    ModelArgs,
    Transformer,
    apply_rotary_emb,
    get_nparams_and_flops,
    precompute_rope_cache,
    rope_inv_freqs,
)

DEBUG_VOCAB = 2256  # vocabulary of the test tokenizer in tests/assets


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def debug_args(**overrides) -> ModelArgs:
    """A copy of the llama3 debug flavor with the test vocabulary (the flavor dict is shared)."""
    return dataclasses.replace(llama3_configs["debugmodel"], vocab_size=DEBUG_VOCAB, **overrides)


def build(args: ModelArgs, seed: int = 0, device: str = "cpu") -> Transformer:
    """The intended construction path: meta build, to_empty, init_weights."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.init_weights()
    return model


def next_token_loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


# --------------------------------------------------------------------------------------------
# Published sizes
# --------------------------------------------------------------------------------------------

# (family, flavor, published parameter count, published FFN hidden size). Sources:
# * Llama 2 counts: parameter counts shown on the Hugging Face model pages of
#   meta-llama/Llama-2-{7b,13b,70b}-hf (6.74B, 13.0B, 69.0B); FFN sizes: "intermediate_size" in
#   their config.json (11008, 13824, 28672).
# * Llama 3 / 3.1 counts: Hugging Face model pages of meta-llama/Meta-Llama-3-8B (8.03B),
#   Meta-Llama-3-70B (70.6B) and Llama-3.1-405B (405.9B, shown rounded as 406B); FFN sizes:
#   "The Llama 3 Herd of Models" (arXiv:2407.21783) Table 3 (14336, 28672, 53248).
# * Llama 3.2 counts: the meta-llama/Llama-3.2-1B model card table "1B (1.23B)" and "3B (3.21B)";
#   FFN sizes: "intermediate_size": 8192 in config.json of Llama-3.2-1B and Llama-3.2-3B.
PUBLISHED = [
    ("llama2", "7B", 6.74e9, 11008),
    ("llama2", "13B", 13.0e9, 13824),
    ("llama2", "70B", 69.0e9, 28672),
    ("llama3", "1B", 1.23e9, 8192),
    ("llama3", "3B", 3.21e9, 8192),
    ("llama3", "8B", 8.03e9, 14336),
    ("llama3", "70B", 70.6e9, 28672),
    ("llama3", "405B", 405.9e9, 53248),
]
PUBLISHED_VOCAB = {"llama2": 32000, "llama3": 128256}


@pytest.mark.parametrize(("family", "flavor", "published", "ffn_dim"), PUBLISHED)
def test_published_sizes(family: str, flavor: str, published: float, ffn_dim: int) -> None:
    configs = llama2_configs if family == "llama2" else llama3_configs
    args = dataclasses.replace(configs[flavor], vocab_size=PUBLISHED_VOCAB[family])
    assert args.ffn_hidden_dim() == ffn_dim
    with torch.device("meta"):
        model = Transformer(args)
    assert model.layers["0"].feed_forward.w1.out_features == ffn_dim
    assert len(model.layers) == args.n_layers
    nparams, flops = get_nparams_and_flops(model, args, seq_len=8192)
    assert abs(nparams - published) / published < 0.01, f"{family} {flavor}: {nparams:,}"
    assert flops > 6 * nparams  # attention term is positive
    # tying is only for Llama 3.2
    assert (model.output.weight is model.tok_embeddings.weight) == (flavor in ("1B", "3B"))


def test_llama32_rope_scaling_and_tying() -> None:
    # Llama 3.2 config.json: rope_scaling factor 32.0; Llama 3.1: factor 8 (the default).
    for flavor in ("1B", "3B"):
        args = llama3_configs[flavor]
        assert args.use_scaled_rope and args.rope_scale_factor == 32.0
        assert args.tie_word_embeddings
    for flavor in ("8B", "70B", "405B"):
        args = llama3_configs[flavor]
        assert args.use_scaled_rope and args.rope_scale_factor == 8.0
        assert not args.tie_word_embeddings


# --------------------------------------------------------------------------------------------
# Debug model on CPU: forward, backward, overfit
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama2", "llama3"])
def test_forward_backward_debug_model(family: str) -> None:
    configs = llama2_configs if family == "llama2" else llama3_configs
    model = build(dataclasses.replace(configs["debugmodel"], vocab_size=DEBUG_VOCAB))
    tokens = torch.randint(0, DEBUG_VOCAB, (4, 65), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    assert logits.shape == (4, 64, DEBUG_VOCAB)
    assert logits.dtype == torch.float32

    loss = next_token_loss(model, tokens)
    assert torch.isfinite(loss)
    # Unit-variance random logits (output std dim**-0.5 on RMS-normalized states) give
    # E[loss] ~= ln(V) + 1/2, so the initial loss sits about 0.5 above ln(V).
    assert abs(loss.item() - math.log(DEBUG_VOCAB)) < 0.75, loss.item()

    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_overfits_one_batch() -> None:
    model = build(debug_args())
    tokens = torch.randint(0, DEBUG_VOCAB, (2, 33), generator=torch.Generator().manual_seed(2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(10):
        loss = next_token_loss(model, tokens)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.4 * losses[0], losses


def test_causality() -> None:
    model = build(debug_args())
    tokens = torch.randint(0, DEBUG_VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    t = 10
    changed = tokens.clone()
    changed[0, t] = (tokens[0, t] + 1) % DEBUG_VOCAB
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, t], b[:, t])


def test_pipeline_stage_pass_through() -> None:
    """Dropping layers / embeddings / head (as pipeline stages do) composes to the full model."""
    args = debug_args()
    full = build(args)
    first, second = build(args), build(args)
    for stage in (first, second):
        stage.load_state_dict(full.state_dict())
    for i in range(3, args.n_layers):
        del first.layers[str(i)]
    first.norm = None
    first.output = None
    for i in range(3):
        del second.layers[str(i)]
    second.tok_embeddings = None
    tokens = torch.randint(0, DEBUG_VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 16, args.dim)
        torch.testing.assert_close(second(hidden), full(tokens))


# --------------------------------------------------------------------------------------------
# Grouped-query attention against a hand-written reference
# --------------------------------------------------------------------------------------------


def reference_rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding written with complex numbers: pair (2i, 2i+1) times e^{i * pos * f_i}."""
    _, seq_len, _, head_dim = x.shape
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)[None, :, None, :]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2)


def test_gqa_matches_reference() -> None:
    args = ModelArgs(dim=48, n_layers=1, n_heads=6, n_kv_heads=2, vocab_size=8, max_seq_len=16)
    torch.manual_seed(5)
    attn = Attention(args)
    x = torch.randn(2, 9, args.dim)
    with torch.no_grad():
        out = attn(x, precompute_rope_cache(args))

        bsz, seq_len, _ = x.shape
        hd, n_rep = args.head_dim, args.n_heads // args.n_kv_heads
        wq, wk, wv = split_qkv(attn.wqkv.weight, args.n_heads, args.n_kv_heads)
        q = reference_rotary((x @ wq.T).view(bsz, seq_len, args.n_heads, hd), args.rope_theta)
        k = reference_rotary((x @ wk.T).view(bsz, seq_len, args.n_kv_heads, hd), args.rope_theta)
        v = (x @ wv.T).view(bsz, seq_len, args.n_kv_heads, hd)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
        heads = []
        for h in range(args.n_heads):
            kv = h // n_rep  # query heads h*n_rep..(h+1)*n_rep-1 share kv head h // n_rep
            scores = q[:, :, h] @ k[:, :, kv].transpose(-1, -2) / math.sqrt(hd)
            scores = scores.masked_fill(~mask, float("-inf"))
            heads.append(scores.softmax(-1) @ v[:, :, kv])
        expected = attn.wo(torch.cat(heads, dim=-1))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_fused_qkv_rows_are_grouped_by_kv_head() -> None:
    # 4 query heads, 2 kv heads, head_dim 1: rows q0 q1 k0 v0 | q2 q3 k1 v1 (Megatron's order)
    wq, wk, wv = (
        torch.arange(4.0)[:, None],
        10 + torch.arange(2.0)[:, None],
        20 + torch.arange(2.0)[:, None],
    )
    fused = fuse_qkv(wq, wk, wv, n_kv_heads=2)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    for a, b in zip(split_qkv(fused, n_heads=4, n_kv_heads=2), (wq, wk, wv)):
        assert torch.equal(a, b)
    # any trailing shape (an optimizer moment of a [rows, dim] weight), head_dim 3
    parts = [torch.randn(n * 3, 5) for n in (6, 2, 2)]
    back = split_qkv(fuse_qkv(*parts, n_kv_heads=2), n_heads=6, n_kv_heads=2)
    assert all(torch.equal(a, b) for a, b in zip(back, parts))


# --------------------------------------------------------------------------------------------
# Rotary embeddings
# --------------------------------------------------------------------------------------------


def test_rope_relative_position() -> None:
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, vocab_size=8, max_seq_len=64)
    cache = precompute_rope_cache(args)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(args.head_dim, generator=gen)
    k = torch.randn(args.head_dim, generator=gen)
    seq_len = 64
    # The same q and k vectors at every position, rotated by their position.
    xq = q.expand(1, seq_len, 1, -1).contiguous()
    xk = k.expand(1, seq_len, 1, -1).contiguous()
    rq, rk = apply_rotary_emb(xq, xk, cache)
    rq, rk = rq[0, :, 0].double(), rk[0, :, 0].double()

    def score(m: int, n: int) -> float:
        return float(rq[m] @ rk[n])

    for offset in (0, 1, 5, 17):
        reference = score(offset, 0)
        for shift in (1, 7, 30, 63 - offset):
            assert score(offset + shift, shift) == pytest.approx(reference, abs=1e-4)
    # ... but the score does change with the offset, and rotation preserves norms.
    assert score(0, 0) != pytest.approx(score(5, 0), abs=1e-3)
    torch.testing.assert_close(rq.norm(dim=-1), torch.full((seq_len,), float(q.norm())).double())


def test_scaled_rope_frequencies() -> None:
    # Llama 3 8B geometry: head_dim 128, theta 500000.
    plain = ModelArgs(dim=4096, n_layers=1, n_heads=32, rope_theta=500000.0, vocab_size=8)
    scaled = dataclasses.replace(plain, use_scaled_rope=True)
    f0, f1 = rope_inv_freqs(plain), rope_inv_freqs(scaled)
    wavelen = 2 * math.pi / f0
    high = wavelen < scaled.rope_original_max_seq_len / scaled.rope_high_freq_factor
    low = wavelen > scaled.rope_original_max_seq_len / scaled.rope_low_freq_factor
    mid = ~(high | low)
    assert high.any() and low.any() and mid.any()
    torch.testing.assert_close(f1[high], f0[high], rtol=0, atol=0)  # high frequencies kept
    torch.testing.assert_close(f1[low], f0[low] / 8.0, rtol=1e-12, atol=0)  # lowest divided by 8
    assert (f1[mid] < f0[mid]).all() and (f1[mid] > f0[mid] / 8.0).all()
    assert f1[0] == f0[0] and f1[-1] == pytest.approx(float(f0[-1]) / 8.0, rel=1e-12)
    # the 3.2 factor 32 divides the lowest frequencies by 32
    f32 = rope_inv_freqs(dataclasses.replace(scaled, rope_scale_factor=32.0))
    torch.testing.assert_close(f32[low], f0[low] / 32.0, rtol=1e-12, atol=0)
    # the cached table holds cos/sin of position * frequency
    cache = precompute_rope_cache(dataclasses.replace(scaled, max_seq_len=4))
    torch.testing.assert_close(cache[3, :, 0], torch.cos(3 * f1).float())
    torch.testing.assert_close(cache[3, :, 1], torch.sin(3 * f1).float())


# --------------------------------------------------------------------------------------------
# Tied embeddings, initialization, FLOPs
# --------------------------------------------------------------------------------------------


def test_tied_embeddings() -> None:
    args = debug_args(tie_word_embeddings=True)
    with torch.device("meta"):
        meta_model = Transformer(args)
    assert meta_model.output.weight is meta_model.tok_embeddings.weight
    model = build(args)  # to_empty must keep the tie
    assert model.output.weight is model.tok_embeddings.weight
    assert not model.output.weight.is_meta
    # the shared matrix is initialized once, with std 0.02 (not N(0, 1))
    assert model.output.weight.std().item() == pytest.approx(0.02, rel=0.05)

    untied = build(debug_args())
    n_tied, flops_tied = get_nparams_and_flops(model, args, seq_len=64)
    n_untied, flops_untied = get_nparams_and_flops(untied, debug_args(), seq_len=64)
    assert n_tied == sum(p.numel() for p in model.parameters())
    assert n_tied == n_untied - DEBUG_VOCAB * args.dim
    assert flops_tied == flops_untied  # the output matmul is still done

    tokens = torch.randint(0, DEBUG_VOCAB, (2, 17), generator=torch.Generator().manual_seed(7))
    loss = next_token_loss(model, tokens)
    assert abs(loss.item() - math.log(DEBUG_VOCAB)) < 0.75
    loss.backward()
    assert torch.isfinite(model.tok_embeddings.weight.grad).all()

    # dtype conversion keeps the tie; bf16 activations still give float32 logits
    model.to(torch.bfloat16)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        logits = model(tokens[:, :8])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_init_deterministic_and_materialized() -> None:
    args = debug_args()
    a, b = build(args, seed=123), build(args, seed=123)
    for tensor in [*a.parameters(), *a.buffers()]:
        assert not tensor.is_meta
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    assert not torch.equal(
        sa["layers.0.attention.wqkv.weight"],
        build(args, seed=7).state_dict()["layers.0.attention.wqkv.weight"],
    )
    assert "rope_cache" not in sa  # non-persistent
    torch.testing.assert_close(a.rope_cache, precompute_rope_cache(args), rtol=0, atol=0)

    # spot-check the initialization scheme
    assert a.tok_embeddings.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert torch.equal(a.norm.weight, torch.ones(args.dim))
    assert torch.equal(a.layers["2"].ffn_norm.weight, torch.ones(args.dim))
    w1 = a.layers["0"].feed_forward.w1.weight
    assert w1.std().item() == pytest.approx(0.02, rel=0.05)
    for layer_id in (0, 5):
        wo = a.layers[str(layer_id)].attention.wo.weight
        expected = 0.02 / math.sqrt(2 * (layer_id + 1))
        assert wo.std().item() == pytest.approx(expected, rel=0.05)
    out = a.output.weight
    assert out.std().item() == pytest.approx(args.dim**-0.5, rel=0.05)
    assert out.abs().max().item() <= 3 * args.dim**-0.5 + 1e-6

    flat = build(dataclasses.replace(args, depth_init=False))
    wo5 = flat.layers["5"].attention.wo.weight
    assert wo5.std().item() == pytest.approx(0.02 / math.sqrt(2 * args.n_layers), rel=0.05)


def test_nparams_and_flops_debug_model_by_hand() -> None:
    args = debug_args()
    with torch.device("meta"):
        model = Transformer(args)
    V, D, L, seq_len = DEBUG_VOCAB, 256, 6, 2048
    kv_dim = 8 * (D // 16)  # n_kv_heads * head_dim = 128
    ffn = 768  # int(2 * 4 * 256 / 3) = 682, rounded up to a multiple of 256
    per_layer = (D * D + 2 * D * kv_dim + D * D) + 3 * D * ffn + 2 * D  # attn + ffn + 2 norms
    total = V * D + L * per_layer + D + D * V  # embedding, layers, final norm, output
    assert total == 5_876_992
    matmul_params = total - V * D
    expected_flops = 6 * matmul_params + 6 * L * D * seq_len
    assert expected_flops == 50_671_104
    assert get_nparams_and_flops(model, args, seq_len=seq_len) == (total, expected_flops)
