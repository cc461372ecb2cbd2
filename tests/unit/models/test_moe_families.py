"""The mixture-of-experts families against transformers' own implementations: Qwen3-MoE
(``Qwen3MoeForCausalLM``) and Llama 4 text (``Llama4ForCausalLM``) at tiny random configs give
the same logits and greedy tokens, weights round-trip exactly through the published layouts,
and the published flavors have the published sizes (total and active parameters)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from hf_oracle import greedy_tokens, logits_gap, round_trip

from torchtitan.errors import HFFormatError
from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.models.common.moe import MoEArgs
from torchtitan.models.llama4.flavors import llama4_configs
from torchtitan.models.llama4.hf_adapter import Llama4StateDictAdapter
from torchtitan.models.llama4.model import Llama4Model, Llama4ModelArgs
from torchtitan.models.qwen3_moe.flavors import qwen3_moe_configs
from torchtitan.models.qwen3_moe.hf_adapter import Qwen3MoeStateDictAdapter
from torchtitan.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _l4_moe(every: int) -> MoEArgs:
    return MoEArgs(
        num_experts=4,
        top_k=1,
        hidden_dim=32,
        score_func="sigmoid",
        score_before_experts=True,
        shared_hidden_dim=32,
        every=every,
    )


# id -> (model class, adapter, args)
TINY = {
    # every layer MoE, top-2 of 8, renormalized weights (the published routing)
    "qwen3_moe": (
        Qwen3MoeModel,
        Qwen3MoeStateDictAdapter,
        Qwen3MoeModelArgs(
            dim=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            head_dim=24,
            hidden_dim=96,
            vocab_size=96,
            max_seq_len=48,
            moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=32, route_norm=True),
        ),
    ),
    # every other layer MoE (decoder_sparse_step 2), weights not renormalized, top-3
    "qwen3_moe_sparse_step_2": (
        Qwen3MoeModel,
        Qwen3MoeStateDictAdapter,
        Qwen3MoeModelArgs(
            dim=48,
            n_layers=4,
            n_heads=6,
            n_kv_heads=2,
            head_dim=16,
            hidden_dim=80,
            vocab_size=80,
            max_seq_len=48,
            rope_theta=10000.0,
            moe=MoEArgs(num_experts=6, top_k=3, hidden_dim=24, route_norm=False, every=2),
        ),
    ),
    # Scout's layout: MoE on every layer, QK-norm, rope scaled; chunks of 8 on the rotary layers
    # and a query temperature from position 3 on the NoPE layer (layer 3), so that both act
    "llama4_scout_like": (
        Llama4Model,
        Llama4StateDictAdapter,
        Llama4ModelArgs(
            dim=64,
            n_layers=4,
            n_heads=4,
            n_kv_heads=2,
            head_dim=16,
            hidden_dim=96,
            vocab_size=96,
            max_seq_len=48,
            use_scaled_rope=True,
            rope_original_max_seq_len=16,
            rope_scale_factor=4.0,
            rope_high_freq_factor=4.0,
            attention_chunk_size=8,
            use_qk_norm=True,
            floor_scale=4,
            attn_scale=0.5,
            moe=_l4_moe(every=1),
        ),
    ),
    # Maverick's: dense and MoE layers alternating, no QK-norm, no rope scaling
    "llama4_maverick_like": (
        Llama4Model,
        Llama4StateDictAdapter,
        Llama4ModelArgs(
            dim=48,
            n_layers=4,
            n_heads=6,
            n_kv_heads=3,
            head_dim=8,
            hidden_dim=80,
            vocab_size=80,
            max_seq_len=48,
            attention_chunk_size=16,
            use_qk_norm=False,
            floor_scale=8,
            moe=_l4_moe(every=2),
        ),
    ),
}


def _ours(flavor: str) -> torch.nn.Module:
    cls, _, args = TINY[flavor]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # norms away from 1; a spread-out router, so routing matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if "router" in name:
                p.mul_(20)
    return model.eval()


def _hf(flavor: str, ours: torch.nn.Module, folder) -> torch.nn.Module:
    """transformers' model loaded from our export, as a user would (transformers 5 fuses
    Qwen3-MoE's per-expert tensors itself when it loads them)."""
    from torchtitan.checkpoint.hf_files import write_folder

    _, adapter_cls, args = TINY[flavor]
    adapter = adapter_cls(args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=None, eos_id=None)
    write_folder(str(folder), adapter.to_hf(ours.state_dict()), config)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="eager"
    )
    assert type(model).__name__ == config["architectures"][0]
    return model.eval()


@pytest.mark.parametrize("flavor", list(TINY))
def test_transformers_computes_the_same_logits(flavor, tmp_path):
    args = TINY[flavor][2]
    ours = _ours(flavor)
    hf = _hf(flavor, ours, tmp_path)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    assert logits_gap(ours, hf, tokens) < 1e-5
    # the routing is exercised: the tokens spread over the experts of every MoE layer
    moe_layers = [layer.moe for layer in ours.layers.values() if layer.moe is not None]
    assert len(moe_layers) == args.n_layers // args.moe.every
    for moe in moe_layers:
        assert (moe.tokens_per_expert > 0).sum() >= args.moe.num_experts // 2


@pytest.mark.parametrize("flavor", list(TINY))
def test_greedy_generation_matches_transformers(flavor, tmp_path):
    """Our model re-run on the growing sequence vs transformers' cached greedy decoding."""
    args = TINY[flavor][2]
    ours = _ours(flavor)
    hf = _hf(flavor, ours, tmp_path)
    prompt = torch.randint(0, args.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    mine, theirs = greedy_tokens(ours, hf, prompt)
    assert mine == theirs


_HF_CLASSES = {
    Qwen3MoeStateDictAdapter: ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    Llama4StateDictAdapter: ("Llama4ForCausalLM", "Llama4TextConfig"),
}


@pytest.mark.parametrize("flavor", list(TINY))
def test_hf_round_trip_is_exact(flavor, tmp_path):
    """transformers' own save (Qwen3-MoE: one tensor per expert; Llama 4: gate_up_proj and
    down_proj stacked and transposed) -> ours -> transformers' names, bit for bit; the expert
    bias, which transformers has no tensor for, starts at zero and is left out."""
    cls, adapter_cls, args = TINY[flavor]
    config = adapter_cls(args).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    model_name, config_name = _HF_CLASSES[adapter_cls]
    torch.manual_seed(5)
    hf = getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
    hf.save_pretrained(tmp_path)
    hf_state = safetensors.load_file(tmp_path / "model.safetensors")
    ours = round_trip(adapter_cls(args), cls, args, hf_state)
    last = args.n_layers - 1  # an MoE layer in every flavor here
    assert ours[f"layers.{last}.moe.experts.w1"].shape == (
        args.moe.num_experts,
        args.moe.hidden_dim,
        args.dim,
    )
    assert not ours[f"layers.{last}.moe.expert_bias"].any()


@pytest.mark.parametrize("flavor", ["qwen3_moe", "llama4_scout_like"])
def test_export_warns_when_the_bias_would_be_lost(flavor, caplog):
    _, adapter_cls, args = TINY[flavor]
    state = _ours(flavor).state_dict()
    state["layers.0.moe.expert_bias"][2] = 0.5
    out = adapter_cls(args).to_hf(state)
    assert not any("bias" in k for k in out)
    assert "layers.0.moe.expert_bias is not zero" in caplog.text


@pytest.mark.parametrize("flavor", list(TINY))
def test_config_round_trip(flavor):
    """Our config.json -> our args, and through transformers' config class (which renames some
    keys: num_experts -> num_local_experts, rope_scaling -> rope_parameters) -> our args."""
    _, adapter_cls, args = TINY[flavor]
    config = adapter_cls(args).hf_config(dtype=torch.bfloat16, bos_id=1, eos_id=2)
    assert adapter_cls.args_from_hf_config(config) == args
    saved = getattr(transformers, _HF_CLASSES[adapter_cls][1])(**config).to_dict()
    assert adapter_cls.args_from_hf_config(json.loads(json.dumps(saved))) == args


def test_llama4_reads_the_text_config_of_a_multimodal_config():
    _, adapter_cls, args = TINY["llama4_scout_like"]
    text = adapter_cls(args).hf_config(dtype=torch.bfloat16, bos_id=1, eos_id=2)
    config = {"model_type": "llama4", "text_config": text, "vision_config": {"hidden_size": 8}}
    assert adapter_cls.args_from_hf_config(config) == args


def test_llama4_imports_the_text_weights_of_a_multimodal_folder(tmp_path):
    """The published Scout and Maverick folders are ``Llama4ForConditionalGeneration`` (model_type
    llama4, text weights under ``language_model.``, vision weights beside them): the family is
    found, the vision weights are left, and the imported model computes transformers' logits."""
    from torchtitan.checkpoint.hf_files import read_hf_model

    _, adapter_cls, args = TINY["llama4_scout_like"]
    text = adapter_cls(args).hf_config(dtype=torch.float32, bos_id=None, eos_id=None)
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=28,
        patch_size=14,
        vision_output_dim=16,
        projector_input_dim=16,
        projector_output_dim=16,
    )
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config=text, vision_config=vision)
    hf = transformers.Llama4ForConditionalGeneration(config).eval()
    with torch.no_grad():  # a spread-out router, so routing matters
        for name, p in hf.named_parameters():
            if "router" in name:
                p.normal_(0, 1)
    hf.save_pretrained(tmp_path)
    spec, got_args, state = read_hf_model(str(tmp_path), "test")
    assert spec.name == "llama4" and got_args == args
    assert not [n for n in state if "vision" in n or "projector" in n]
    ours = Llama4Model(got_args)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"rope_cache"}, (missing, unexpected)
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf.language_model(tokens).logits.float()
        got = ours.eval()(tokens)
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "flavor, change, words",
    [
        ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
        ("qwen3_moe", {"num_experts": None}, "needs num_experts"),
        ("llama4_scout_like", {"no_rope_layers": [0, 1, 1, 1]}, "no_rope_layers"),
        ("llama4_scout_like", {"moe_layers": [0]}, "moe_layers"),
        ("llama4_scout_like", {"rope_scaling": {"rope_type": "yarn"}}, "rope type 'yarn'"),
        ("llama4_scout_like", {"num_local_experts": None}, "num_local_experts"),
    ],
)
def test_configs_these_models_cannot_build_are_refused(flavor, change, words):
    _, adapter_cls, args = TINY[flavor]
    config = adapter_cls(args).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    with pytest.raises(HFFormatError, match=re.escape(words)):
        adapter_cls.args_from_hf_config(config)


def test_llama4_chunks_and_temperature_act():
    """The tiny Scout-like model's logits change when the chunks or the temperature do (so the
    comparison with transformers covers both), and match plain causal attention when neither
    acts (chunks longer than the sequence, temperature off)."""
    cls, _, args = TINY["llama4_scout_like"]
    tokens = torch.randint(0, args.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))

    def logits(**change) -> torch.Tensor:
        torch.manual_seed(0)
        model = cls(dataclasses.replace(args, **change))
        model.init_weights()
        with torch.no_grad():
            return model(tokens)

    base = logits()
    # the first chunk (positions 0-7) and the positions before the temperature rises (0-2) are
    # the same; later ones differ
    for change, same in (({"attention_chunk_size": 16}, 8), ({"attn_scale": 0.0}, 3)):
        diff = (logits(**change) - base).abs().amax(-1)[0]
        assert not diff[:same].any() and (diff[same:] > 1e-6).all(), (change, diff)
    plain = logits(attention_chunk_size=None, attn_temperature_tuning=False)
    same = logits(attention_chunk_size=48, attn_scale=0.0)
    assert torch.equal(plain, same)


# family, flavor -> (total, activated) in billions, as the model cards print them
PUBLISHED = {
    ("qwen3_moe", "30B-A3B"): ("30.5", "3.3"),
    ("qwen3_moe", "235B-A22B"): ("235", "22"),
    ("llama4", "17bx16e"): ("109", "17"),
    ("llama4", "17bx128e"): ("400", "17"),
}
# Llama 4's published totals count its vision encoder and projector too, which the text model
# here leaves out: its text total may fall short of the card's by at most this fraction
VISION_SHARE = 0.02
_FAMILIES = {
    "qwen3_moe": (Qwen3MoeModel, qwen3_moe_configs),
    "llama4": (Llama4Model, llama4_configs),
}

# family -> flavor -> the published config.json keys (Llama 4: its text_config)
_QWEN3_MOE_SHARED = dict(
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    vocab_size=151936,
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
)
_LLAMA4_SHARED = dict(
    hidden_size=5120,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=8192,
    intermediate_size_mlp=16384,
    num_experts_per_tok=1,
    vocab_size=202048,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    attention_chunk_size=8192,
    no_rope_layer_interval=4,
    attn_temperature_tuning=True,
    floor_scale=8192,
    attn_scale=0.1,
    tie_word_embeddings=False,
)
PUBLISHED_CONFIGS = {
    ("qwen3_moe", "30B-A3B"): {
        **_QWEN3_MOE_SHARED,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
    },
    ("qwen3_moe", "235B-A22B"): {
        **_QWEN3_MOE_SHARED,
        "hidden_size": 4096,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
    },
    ("llama4", "17bx16e"): {
        **_LLAMA4_SHARED,
        "num_local_experts": 16,
        "interleave_moe_layer_step": 1,
        "use_qk_norm": True,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 16.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
        },
    },
    ("llama4", "17bx128e"): {
        **_LLAMA4_SHARED,
        "num_local_experts": 128,
        "interleave_moe_layer_step": 2,
        "use_qk_norm": False,
        "rope_scaling": None,
    },
}


@pytest.mark.parametrize("family, flavor", list(PUBLISHED_CONFIGS))
def test_flavor_is_the_published_config(family, flavor):
    """Our flavor written as config.json equals the published one on every architecture key."""
    spec_adapter = {"qwen3_moe": Qwen3MoeStateDictAdapter, "llama4": Llama4StateDictAdapter}
    args = _FAMILIES[family][1][flavor]
    config = spec_adapter[family](args).hf_config(dtype=torch.bfloat16, bos_id=None, eos_id=None)
    for key, value in PUBLISHED_CONFIGS[family, flavor].items():
        assert config[key] == value, (flavor, key, config[key])


def _active(model, args) -> int:
    total, flops = get_nparams_and_flops(model, args, seq_len=4096)
    attention = 6 * args.n_layers * args.n_heads * args.head_dim * 4096
    return (flops - attention) // 6 + model.tok_embeddings.weight.numel()


def test_published_parameter_counts_total_and_active():
    """Within 1% of the model cards, or equal to the card's figure at the precision it prints
    (30B-A3B's card prints "3.3B activated" for 3.35B: its digits cut, not rounded); Llama 4's
    text totals below the cards' multimodal totals by at most VISION_SHARE. FLOPs per token come
    from the active parameters only."""
    bad, rows = [], []
    for (family, flavor), published in PUBLISHED.items():
        cls, flavors = _FAMILIES[family]
        args = flavors[flavor]
        with torch.device("meta"):
            model = cls(args)
        total, _ = get_nparams_and_flops(model, args, seq_len=4096)
        for what, ours, shown in zip(("total", "active"), (total, _active(model, args)), published):
            rel = ours / (float(shown) * 1e9) - 1
            decimals = len(shown.split(".")[1]) if "." in shown else 0
            rows.append(f"{flavor} {what} {ours:,} vs {shown}B ({100 * rel:+.2f}%)")
            cut = int(ours / 1e9 * 10**decimals) / 10**decimals
            printed = {f"{ours / 1e9:.{decimals}f}", f"{cut:.{decimals}f}"}
            close = abs(rel) <= 0.01 or shown in printed
            if family == "llama4" and what == "total":
                close = -VISION_SHARE <= rel <= 0.01
            if not close:
                bad.append(rows[-1])
    print("\n".join(rows))
    assert not bad, "\n".join(rows)


def test_flops_count_the_active_experts_only():
    args = TINY["qwen3_moe"][2]
    dense_like = dataclasses.replace(args, moe=dataclasses.replace(args.moe, top_k=8))
    with torch.device("meta"):
        model, full = Qwen3MoeModel(args), Qwen3MoeModel(dense_like)
    n, flops = get_nparams_and_flops(model, args, seq_len=16)
    n_full, flops_full = get_nparams_and_flops(full, dense_like, seq_len=16)
    experts = args.n_layers * 3 * 8 * 32 * args.dim
    assert n == n_full  # the same parameters
    assert flops_full - flops == 6 * experts * 6 // 8  # 6 of 8 experts idle per token


def test_registered_train_spec_and_debug_flavor():
    from torchtitan.models.spec import get_model_args, get_model_spec, spec_for_hf_config

    spec = get_model_spec("qwen3_moe")
    assert spec.cls is Qwen3MoeModel and spec.state_dict_adapter is Qwen3MoeStateDictAdapter
    assert spec_for_hf_config({"model_type": "qwen3_moe"}, "test") is spec
    args = get_model_args("qwen3_moe", "debugmodel")
    assert args.vocab_size == -1 and not args.tie_word_embeddings
    assert args.moe.num_experts == 8 and args.moe.top_k == 2 and args.moe.route_norm

    spec = get_model_spec("llama4")
    assert spec.cls is Llama4Model and spec.state_dict_adapter is Llama4StateDictAdapter
    assert spec_for_hf_config({"model_type": "llama4_text"}, "test") is spec
    args = get_model_args("llama4", "debugmodel")
    assert args.moe.score_before_experts and args.moe.shared_hidden_dim and args.moe.top_k == 1
    assert [args.uses_rope(i) for i in range(4)] == [True, True, True, False]
    maverick = get_model_args("llama4", "debugmodel_interleaved")
    assert [maverick.moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
