"""Qwen3 (dense) against transformers' Qwen3ForCausalLM: the same logits and greedy tokens, exact
weight and config round trips, the published sizes, and the FLOPs formula. Fast, one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_oracle import greedy_tokens, logits_gap, round_trip

from torchtitan.errors import HFFormatError
from torchtitan.models.qwen3.flavors import QWEN3_VOCAB_SIZE, qwen3_configs
from torchtitan.models.qwen3.hf_adapter import Qwen3StateDictAdapter
from torchtitan.models.qwen3.model import (
    Qwen3Model,
    Qwen3ModelArgs,
    apply_rotary_emb,
    get_nparams_and_flops,
    precompute_rope_cache,
)

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# head_dim 24 != dim / n_heads (16), grouped-query attention (4 query heads per kv head)
TINY = {
    "untied": Qwen3ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        head_dim=24,
        hidden_dim=96,
        vocab_size=96,
        max_seq_len=48,
    ),
    "tied": Qwen3ModelArgs(
        dim=48,
        n_layers=2,
        n_heads=6,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=80,
        vocab_size=80,
        max_seq_len=48,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
}


def _ours(args: Qwen3ModelArgs) -> Qwen3Model:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3Model(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # norms away from 1, so a swapped or skipped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _hf(args: Qwen3ModelArgs, ours: Qwen3Model) -> torch.nn.Module:
    adapter = Qwen3StateDictAdapter(args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=None, eos_id=None)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).eval()
    missing, unexpected = model.load_state_dict(adapter.to_hf(ours.state_dict()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if args.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("flavor", list(TINY))
def test_transformers_computes_the_same_logits(flavor):
    args = TINY[flavor]
    ours = _ours(args)
    hf = _hf(args, ours)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    assert logits_gap(ours, hf, tokens) < 1e-5


@pytest.mark.parametrize("flavor", list(TINY))
def test_greedy_generation_matches_transformers(flavor):
    """Our model re-run on the growing sequence vs transformers' cached greedy decoding."""
    args = TINY[flavor]
    ours = _ours(args)
    hf = _hf(args, ours)
    prompt = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    mine, theirs = greedy_tokens(ours, hf, prompt)
    assert mine == theirs


def test_rotary_is_transformers_half_split_layout():
    args = TINY["untied"]
    q = torch.randn(2, 10, 4, args.head_dim, generator=torch.Generator().manual_seed(3))
    k = torch.randn(2, 10, 1, args.head_dim, generator=torch.Generator().manual_seed(4))
    rq, rk = apply_rotary_emb(q, k, precompute_rope_cache(args))

    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

    config = transformers.Qwen3Config(
        **Qwen3StateDictAdapter(dataclasses.replace(args, vocab_size=96)).hf_config(
            dtype=torch.float32, bos_id=None, eos_id=None
        )
    )
    cos, sin = Qwen3RotaryEmbedding(config)(q, torch.arange(10).unsqueeze(0))
    hq, hk = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(rq, hq.transpose(1, 2), atol=1e-6, rtol=0)
    torch.testing.assert_close(rk, hk.transpose(1, 2), atol=1e-6, rtol=0)
    assert precompute_rope_cache(args).shape == (args.max_seq_len, 2, args.head_dim)


def test_shapes_decouple_head_dim_from_dim():
    args = TINY["untied"]
    attention = _ours(args).layers["0"].attention
    q_rows, kv_rows = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim  # 96, 32
    assert attention.wqkv.weight.shape == (q_rows + 2 * kv_rows, args.dim)
    assert attention.wo.weight.shape == (args.dim, args.n_heads * args.head_dim)
    assert attention.q_norm.weight.shape == attention.k_norm.weight.shape == (args.head_dim,)


def test_init_resets_qk_norms_and_is_deterministic():
    args = TINY["tied"]
    torch.manual_seed(0)
    a = Qwen3Model(args)
    a.init_weights()
    torch.manual_seed(0)
    b = Qwen3Model(args)
    b.init_weights()
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    assert a.output.weight is a.tok_embeddings.weight
    block = a.layers["1"]
    assert block.attention.wo.weight.std().item() < block.attention.wqkv.weight.std().item()


# ----------------------------------------------------------------------------- HF conversion


@pytest.mark.parametrize("flavor", list(TINY))
def test_hf_round_trip_is_exact(flavor):
    """transformers' weights -> ours -> transformers' names, bit for bit (and back)."""
    args = TINY[flavor]
    torch.manual_seed(5)
    hf_config = Qwen3StateDictAdapter(args).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**hf_config))
    hf_state = {k: v for k, v in hf.state_dict().items()}
    if args.tie_word_embeddings:
        del hf_state["lm_head.weight"]  # what save_pretrained writes for tied embeddings
    round_trip(Qwen3StateDictAdapter(args), Qwen3Model, args, hf_state)


@pytest.mark.parametrize("flavor", list(TINY))
def test_config_round_trip(flavor):
    """Our config.json through transformers (which rewrites rope_theta into rope_parameters)
    and back gives the same hyper-parameters."""
    args = TINY[flavor]
    config = Qwen3StateDictAdapter(args).hf_config(dtype=torch.bfloat16, bos_id=1, eos_id=2)
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert Qwen3StateDictAdapter.args_from_hf_config(config) == args
    saved = transformers.Qwen3Config(**config).to_dict()
    assert "rope_parameters" in saved
    assert Qwen3StateDictAdapter.args_from_hf_config(saved) == args


def test_mismatches_are_listed_in_one_error():
    args = TINY["untied"]
    adapter = Qwen3StateDictAdapter(args)
    state = _ours(args).state_dict()
    hf_state = adapter.to_hf(state)
    del hf_state["model.layers.1.self_attn.k_norm.weight"]
    hf_state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(96)
    hf_state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    with pytest.raises(HFFormatError) as e:
        adapter.from_hf(hf_state, {k: v.shape for k, v in state.items()})
    msg = str(e.value)
    assert "\n" not in msg
    assert "1 missing: model.layers.1.self_attn.k_norm.weight" in msg
    assert "1 unexpected: model.layers.0.self_attn.q_proj.bias" in msg
    assert "1 shape: model.layers.0.self_attn.q_norm.weight (16,) vs (24,)" in msg


@pytest.mark.parametrize(
    "change, words",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_hidden_layers": None}, "not a Qwen3 config"),
    ],
)
def test_configs_this_model_cannot_build_are_refused(change, words):
    config = Qwen3StateDictAdapter(TINY["tied"]).hf_config(
        dtype=torch.float32, bos_id=None, eos_id=None
    )
    with pytest.raises(HFFormatError, match=words):
        Qwen3StateDictAdapter.args_from_hf_config({**config, **change})


# ----------------------------------------------------------------------------- published sizes

# flavor: (hidden_size, num_hidden_layers, num_attention_heads, intermediate_size,
#          tie_word_embeddings) of Qwen/Qwen3-<flavor>/config.json (num_key_value_heads 8,
#          head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, max_position_embeddings 40960), and
#          the model card's "Number of Parameters" and "Number of Parameters (Non-Embedding)"
PUBLISHED = {
    "0.6B": ((1024, 28, 16, 3072, True), "0.6", "0.44"),
    "1.7B": ((2048, 28, 16, 6144, True), "1.7", "1.4"),
    "4B": ((2560, 36, 32, 9728, True), "4.0", "3.6"),
    "8B": ((4096, 36, 32, 12288, False), "8.2", "6.95"),
    "14B": ((5120, 40, 40, 17408, False), "14.8", "13.2"),
    "32B": ((5120, 64, 64, 25600, False), "32.8", "31.2"),
}


def _published_config(flavor: str) -> dict:
    (hidden, layers, heads, inter, tied), _, _ = PUBLISHED[flavor]
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": 40960,
        "max_window_layers": layers,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": tied,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_flavor_is_the_published_config(flavor):
    assert (
        Qwen3StateDictAdapter.args_from_hf_config(_published_config(flavor))
        == (qwen3_configs[flavor])
    )


def test_keys_left_out_take_transformers_defaults():
    left_out = (
        "head_dim",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
    )
    config = {k: v for k, v in _published_config("0.6B").items() if k not in left_out}
    ours = Qwen3StateDictAdapter.args_from_hf_config(config)
    hf = transformers.Qwen3Config(**config)
    assert (ours.head_dim, ours.rope_theta, ours.max_seq_len, ours.norm_eps) == (
        hf.head_dim,
        hf.rope_parameters["rope_theta"],
        hf.max_position_embeddings,
        hf.rms_norm_eps,
    )
    assert ours.tie_word_embeddings == hf.tie_word_embeddings


def _counts(args: Qwen3ModelArgs) -> tuple[int, int]:
    with torch.device("meta"):
        model = Qwen3Model(args)
    total, _ = get_nparams_and_flops(model, args, seq_len=4096)
    embeddings = {id(p): p.numel() for p in (model.tok_embeddings.weight, model.output.weight)}
    return total, total - sum(embeddings.values())


def test_published_parameter_counts():
    """Within 1% of the model cards, or equal to the card's figure at the precision it is printed
    with (the card prints 1.7B for 1.72B: 2 significant digits)."""
    rows, bad = [], []
    for flavor, (_, *published) in PUBLISHED.items():
        counts = _counts(qwen3_configs[flavor])
        for what, ours, shown in zip(("total", "non-embedding"), counts, published):
            rel = ours / (float(shown) * 1e9) - 1
            decimals = len(shown.split(".")[1])
            ok = abs(rel) <= 0.01 or f"{ours / 1e9:.{decimals}f}" == shown
            rows.append(f"{flavor:>5} {what:>13} {ours:>15,} {shown:>6}B {100 * rel:+6.2f}%")
            if not ok:
                bad.append(rows[-1])
    table = "\n".join(["flavor          what            ours  published   diff", *rows])
    assert not bad, f"off the published counts: {bad}\n{table}"


def test_flops_formula():
    """6 x (matmul parameters) + the attention term over the query width n_heads * head_dim."""
    args = dataclasses.replace(qwen3_configs["debugmodel"], vocab_size=2256, max_seq_len=64)
    with torch.device("meta"):
        model = Qwen3Model(args)
    nparams, flops = get_nparams_and_flops(model, args, seq_len=64)
    d, h, L = args.dim, args.hidden_dim, args.n_layers
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    per_block = d * q + 2 * d * kv + q * d + 3 * d * h + 2 * d + 2 * args.head_dim
    assert nparams == 2256 * d + L * per_block + d  # tied: the embedding counted once
    assert flops == 6 * nparams + 6 * L * q * 64  # tied output is still a matmul: 6 x nparams
    assert q == 2 * d  # the attention term uses the query width, not dim

    untied = dataclasses.replace(args, tie_word_embeddings=False)
    with torch.device("meta"):
        untied_model = Qwen3Model(untied)
    n2, flops2 = get_nparams_and_flops(untied_model, untied, seq_len=64)
    assert n2 == nparams + 2256 * d and flops2 == flops  # the embedding lookup is free


def test_registered_train_spec_and_debug_flavor():
    from torchtitan.models.spec import get_model_args, get_model_spec, spec_for_hf_config

    spec = get_model_spec("qwen3")
    assert spec.cls is Qwen3Model and spec.state_dict_adapter is Qwen3StateDictAdapter
    assert spec_for_hf_config({"model_type": "qwen3"}, "test") is spec
    args = get_model_args("qwen3", "debugmodel")
    assert args.head_dim * args.n_heads != args.dim and args.tie_word_embeddings
    assert args.vocab_size == -1 and QWEN3_VOCAB_SIZE == 151936
    untied = get_model_args("qwen3", "debugmodel_untied")  # for pipeline parallel
    assert untied == dataclasses.replace(args, tie_word_embeddings=False)
    # what preflight and the trainer do with it
    cut = dataclasses.replace(args, norm_type="compiled_rmsnorm", n_layers=2, vocab_size=2256)
    assert cut.ffn_hidden_dim() == args.hidden_dim
    model = Qwen3Model(cut)
    assert type(model.layers["0"].attention.q_norm).__name__ == "CompiledRMSNorm"


def test_published_flavor_keeps_its_padded_table_for_its_own_tokenizer():
    """Qwen3's 151,669-token tokenizer sizes the embedding at the published 151,936 rows (so the
    published weights load); another tokenizer for a published flavor is still refused."""
    from torchtitan.config.parse import parse_args
    from torchtitan.errors import ConfigError
    from torchtitan.train.plan import check_vocab

    cfg = parse_args(["--model.name", "qwen3", "--model.flavor", "0.6B"], need_files=False)
    args = qwen3_configs["0.6B"]
    assert check_vocab(cfg, args, 151669) == 151936
    assert check_vocab(cfg, args, 151936) == 151936
    with pytest.raises(ConfigError, match="has 2,256 tokens, but qwen3 0.6B has a vocabulary"):
        check_vocab(cfg, args, 2256)
    assert check_vocab(cfg, qwen3_configs["debugmodel"], 2256) == 2256
