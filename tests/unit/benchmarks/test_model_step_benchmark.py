"""The model-step benchmark (benchmarks/model_step.py, imported, not run as a process): its
hand-written reference model has our parameter count and computes the same function, and its
paired timing returns positive times."""

from __future__ import annotations

import math

import torch
from repo_paths import load_script

BENCH = load_script("model_step", folder="benchmarks")
TINY = BENCH.Shape("tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab=128, seq=16, batch=2)


def test_reference_has_our_parameter_count():
    for shape in (TINY, BENCH.SHAPES["debug"]):
        with torch.device("meta"):
            ours = BENCH.Transformer(shape.model_args())
            ref = BENCH.ReferenceModel(shape.model_args())
        assert BENCH.n_params(ref) == BENCH.n_params(ours)


def test_reference_loss_at_init_is_about_ln_vocab():
    ref = BENCH.build_reference(TINY, "cpu")
    batch = BENCH.make_batches(TINY, 1, "cpu")[0]
    with torch.no_grad():
        loss = BENCH.reference_loss(ref(batch[:, :-1]), batch[:, 1:]).item()
    assert math.isfinite(loss)
    assert abs(loss - math.log(TINY.vocab)) < 0.3


def _half_split(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved rotary pairs (ours) to rotate-half order."""
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    return weight.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def _our_qkv(attention: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """Our query, key and value projection weights, whether separate or fused as ``wqkv``."""
    if hasattr(attention, "wq"):
        return attention.wq.weight, attention.wk.weight, attention.wv.weight
    from torchtitan.models.common.blocks import split_qkv

    return split_qkv(attention.wqkv.weight, TINY.n_heads, TINY.n_kv_heads)


def test_reference_computes_our_function():
    ours, ref = BENCH.build_ours(TINY, "cpu"), BENCH.build_reference(TINY, "cpu")
    hd = TINY.dim // TINY.n_heads
    with torch.no_grad():
        ref.embed.weight.copy_(ours.tok_embeddings.weight)
        for block, layer in zip(ref.blocks, ours.layers.values()):
            att, ff = layer.attention, layer.feed_forward
            wq, wk, wv = _our_qkv(att)
            block.qkv.weight.copy_(torch.cat((_half_split(wq, hd), _half_split(wk, hd), wv)))
            block.wo.weight.copy_(att.wo.weight)
            for name in ("w1", "w2", "w3"):
                getattr(block, name).weight.copy_(getattr(ff, name).weight)
            block.attn_norm.copy_(layer.attention_norm.weight.add(0.1))
            block.mlp_norm.copy_(layer.ffn_norm.weight.sub(0.1))
            layer.attention_norm.weight.add_(0.1)
            layer.ffn_norm.weight.sub_(0.1)
        ref.output.weight.copy_(ours.output.weight)
        tokens = BENCH.make_batches(TINY, 1, "cpu")[0, :, :-1]
        torch.testing.assert_close(ref(tokens), ours(tokens), rtol=1e-4, atol=1e-4)


def test_timing_rows_have_positive_times():
    rows = BENCH.time_shapes([TINY], "cpu", warmup=0, rounds=1, steps=1)
    assert [r["shape"] for r in rows] == ["tiny"]
    row = rows[0]
    for key in ("ours_cpu_ms", "ref_cpu_ms", "ratio_cpu", "ours_wall_ms", "ref_wall_ms"):
        assert row[key] > 0, key
    assert row["params"] == BENCH.n_params(BENCH.build_reference(TINY, "cpu"))
    assert "tiny" in BENCH.format_timing(rows)
