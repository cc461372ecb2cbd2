"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: the same logits and greedy tokens, exact
weight round trips through the published per-expert layout, the published sizes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from torchtitan.errors import HFFormatError
from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.qwen3_moe.flavors import qwen3_moe_configs
from torchtitan.models.qwen3_moe.hf_adapter import Qwen3MoeStateDictAdapter
from torchtitan.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TINY = {
    # every layer MoE, top-2 of 8, renormalized weights (the published routing)
    "every_layer": Qwen3MoeModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, hidden_dim=96, vocab_size=96,
        max_seq_len=48, moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, route_norm=True),
    ),
    # every other layer MoE (decoder_sparse_step 2), weights not renormalized, top-3
    "sparse_step_2": Qwen3MoeModelArgs(
        dim=48, n_layers=4, n_heads=6, n_kv_heads=2, head_dim=16, hidden_dim=80, vocab_size=80,
        max_seq_len=48, rope_theta=10000.0,
        moe=MoEArgs(num_experts=6, top_k=3, hidden_dim=24, route_norm=False, every=2),
    ),
}  # fmt: skip


def _ours(args: Qwen3MoeModelArgs) -> Qwen3MoeModel:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3MoeModel(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # norms away from 1; a spread-out router, so routing matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if "router" in name:
                p.mul_(20)
    return model.eval()


def _save_hf(args: Qwen3MoeModelArgs, state: dict, folder) -> None:
    from torchtitan.checkpoint.hf_files import write_folder

    adapter = Qwen3MoeStateDictAdapter(args)
    write_folder(str(folder), adapter.to_hf(state), adapter.hf_config(
        dtype=torch.float32, bos_id=None, eos_id=None))  # fmt: skip


def _hf(args: Qwen3MoeModelArgs, ours: Qwen3MoeModel, folder) -> torch.nn.Module:
    """transformers' model loaded from our export (transformers 5 fuses the per-expert tensors
    of the published layout itself when it loads them)."""
    _save_hf(args, ours.state_dict(), folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    return model.eval()


@pytest.mark.parametrize("flavor", list(TINY))
def test_transformers_computes_the_same_logits(flavor, tmp_path):
    args = TINY[flavor]
    ours = _ours(args)
    hf = _hf(args, ours, tmp_path)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(tokens)
        got = hf(tokens).logits.float()
    assert expected.shape == (2, 40, args.vocab_size)
    assert (got - expected).abs().max().item() < 1e-5
    # the routing is exercised: the tokens spread over the experts of every MoE layer
    for layer in ours.layers.values():
        if layer.moe is not None:
            assert (layer.moe.tokens_per_expert > 0).sum() >= args.moe.num_experts // 2


@pytest.mark.parametrize("flavor", list(TINY))
def test_greedy_generation_matches_transformers(flavor, tmp_path):
    """Our model re-run on the growing sequence vs transformers' cached greedy decoding."""
    args = TINY[flavor]
    ours = _ours(args)
    hf = _hf(args, ours, tmp_path)
    prompt = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            nxt = ours(seq)[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
        got = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                          max_new_tokens=8, min_new_tokens=8, pad_token_id=0)  # fmt: skip
    assert got.tolist() == seq.tolist()


@pytest.mark.parametrize("flavor", list(TINY))
def test_hf_round_trip_is_exact(flavor, tmp_path):
    """transformers' own save (per-expert tensors) -> ours -> transformers' names, bit for bit;
    the expert bias, which transformers has no tensor for, starts at zero and is left out."""
    args = TINY[flavor]
    config = Qwen3MoeStateDictAdapter(args).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    torch.manual_seed(5)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config))
    hf.save_pretrained(tmp_path)
    hf_state = safetensors.load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in hf_state
    adapter = Qwen3MoeStateDictAdapter(args)
    expected = {k: v.shape for k, v in Qwen3MoeModel(args).state_dict().items()}
    ours = adapter.from_hf(hf_state, expected)
    assert ours.keys() == expected.keys()
    assert ours["layers.1.moe.experts.w1"].shape == (args.moe.num_experts, 32 if flavor ==
                                                      "every_layer" else 24, args.dim)  # fmt: skip
    assert not ours["layers.1.moe.expert_bias"].any()
    back = adapter.to_hf(ours)
    assert back.keys() == hf_state.keys()
    for k in hf_state:
        assert torch.equal(back[k], hf_state[k]), k


def test_export_warns_when_the_bias_would_be_lost(caplog):
    args = TINY["every_layer"]
    state = _ours(args).state_dict()
    state["layers.0.moe.expert_bias"][2] = 0.5
    out = Qwen3MoeStateDictAdapter(args).to_hf(state)
    assert not any("bias" in k for k in out)
    assert "layers.0.moe.expert_bias is not zero" in caplog.text


@pytest.mark.parametrize("flavor", list(TINY))
def test_config_round_trip(flavor):
    args = TINY[flavor]
    config = Qwen3MoeStateDictAdapter(args).hf_config(dtype=torch.bfloat16, bos_id=1, eos_id=2)
    assert config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert Qwen3MoeStateDictAdapter.args_from_hf_config(config) == args
    saved = transformers.Qwen3MoeConfig(**config).to_dict()
    assert Qwen3MoeStateDictAdapter.args_from_hf_config(json.loads(json.dumps(saved))) == args


def test_configs_this_model_cannot_build_are_refused():
    config = Qwen3MoeStateDictAdapter(TINY["every_layer"]).hf_config(
        dtype=torch.float32, bos_id=1, eos_id=2)  # fmt: skip
    with pytest.raises(HFFormatError, match="mlp_only_layers"):
        Qwen3MoeStateDictAdapter.args_from_hf_config({**config, "mlp_only_layers": [0]})
    with pytest.raises(HFFormatError, match="num_experts"):
        Qwen3MoeStateDictAdapter.args_from_hf_config(
            {k: v for k, v in config.items() if k != "num_experts"}
        )


# (total, activated) in billions, as the model cards print them
PUBLISHED = {"30B-A3B": ("30.5", "3.3"), "235B-A22B": ("235", "22")}


def test_flavor_is_the_published_config():
    """Our flavor written as config.json equals the published one on every architecture key."""
    published = {
        "30B-A3B": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                        intermediate_size=6144, moe_intermediate_size=768),
        "235B-A22B": dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                          intermediate_size=12288, moe_intermediate_size=1536),
    }  # fmt: skip
    shared = dict(num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  norm_topk_prob=True, decoder_sparse_step=1, vocab_size=151936,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
                  max_position_embeddings=40960)  # fmt: skip
    for flavor, own in published.items():
        config = Qwen3MoeStateDictAdapter(qwen3_moe_configs[flavor]).hf_config(
            dtype=torch.bfloat16, bos_id=None, eos_id=None)  # fmt: skip
        for key, value in {**shared, **own}.items():
            assert config[key] == value, (flavor, key)


def _active(model, args) -> int:
    total, flops = get_nparams_and_flops(model, args, seq_len=4096)
    attention = 6 * args.n_layers * args.n_heads * args.head_dim * 4096
    return (flops - attention) // 6 + model.tok_embeddings.weight.numel()


def test_published_parameter_counts_total_and_active():
    """Within 1% of the model cards, or equal to the card's figure at the precision it prints
    (30B-A3B's card prints "3.3B activated" for 3.35B: its digits cut, not rounded); FLOPs per
    token come from the active parameters only."""
    bad, rows = [], []
    for flavor, published in PUBLISHED.items():
        args = qwen3_moe_configs[flavor]
        with torch.device("meta"):
            model = Qwen3MoeModel(args)
        total, _ = get_nparams_and_flops(model, args, seq_len=4096)
        for what, ours, shown in zip(("total", "active"), (total, _active(model, args)), published):
            rel = ours / (float(shown) * 1e9) - 1
            decimals = len(shown.split(".")[1]) if "." in shown else 0
            rows.append(f"{flavor} {what} {ours:,} vs {shown}B ({100 * rel:+.2f}%)")
            cut = int(ours / 1e9 * 10**decimals) / 10**decimals
            printed = {f"{ours / 1e9:.{decimals}f}", f"{cut:.{decimals}f}"}
            if abs(rel) > 0.01 and shown not in printed:
                bad.append(rows[-1])
    assert not bad, "\n".join(rows)


def test_flops_count_the_active_experts_only():
    args = dataclasses.replace(TINY["every_layer"], vocab_size=96)
    dense_like = dataclasses.replace(args, moe=dataclasses.replace(args.moe, top_k=8))
    with torch.device("meta"):
        model, full = Qwen3MoeModel(args), Qwen3MoeModel(dense_like)
    n, flops = get_nparams_and_flops(model, args, seq_len=16)
    n_full, flops_full = get_nparams_and_flops(full, dense_like, seq_len=16)
    experts = args.n_layers * 3 * 8 * 32 * args.dim
    assert n == n_full  # the same parameters
    assert flops_full - flops == 6 * experts * 6 // 8  # 6 of 8 experts idle per token


def test_registered_train_spec_and_debug_flavor():
    from torchtitan.train_spec import get_model_args, get_train_spec, spec_for_hf_config

    spec = get_train_spec("qwen3_moe")
    assert spec.cls is Qwen3MoeModel and spec.state_dict_adapter is Qwen3MoeStateDictAdapter
    assert spec_for_hf_config({"model_type": "qwen3_moe"}, "test") is spec
    args = get_model_args("qwen3_moe", "debugmodel")
    assert args.vocab_size == -1 and not args.tie_word_embeddings
    assert args.moe.num_experts == 8 and args.moe.top_k == 2 and args.moe.route_norm
