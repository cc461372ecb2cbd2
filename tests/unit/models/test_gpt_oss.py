"""gpt-oss against ``transformers``' ``GptOssForCausalLM`` at tiny random configs: logits and
greedy tokens (both layer kinds, a window shorter than the sequence, sinks and biases far from
zero), weights round-trip exactly through the published layout, an MXFP4 folder written with
the published layout imports to the logits ``transformers`` computes from it, and the published
flavors have the model card's sizes."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from hf_oracle import export, greedy_tokens, hf_from, logits_gap, round_trip

from torchtitan.checkpoint.hf_files import dequantize_mxfp4, read_hf_model, write_folder
from torchtitan.errors import HFFormatError
from torchtitan.models.common.decoder import get_nparams_and_flops
from torchtitan.models.common.moe import inactive_params
from torchtitan.models.gpt_oss.flavors import gpt_oss_configs
from torchtitan.models.gpt_oss.hf_adapter import GptOssStateDictAdapter
from torchtitan.models.gpt_oss.model import GptOssModel, GptOssModelArgs, gpt_oss_moe

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# 4 layers (sliding, full, sliding, full), a window of 6 over sequences of 40; hidden sizes
# multiples of 32 so that an MXFP4 export of the experts is possible
TINY = GptOssModelArgs(
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    vocab_size=96,
    max_seq_len=64,
    sliding_window=6,
    rope_original_max_seq_len=16,
    rope_factor=4.0,
    moe=gpt_oss_moe(num_experts=8, top_k=2, hidden_dim=32),
)


def _ours(args: GptOssModelArgs = TINY) -> GptOssModel:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GptOssModel(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():  # norms away from 1; biases, sinks and a spread-out router that bite
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "router" in name or "sinks" in name:
                p.normal_(0, 1)
            elif "bias" in name or name.endswith("_bias"):
                p.normal_(0, 0.2)
            elif "experts.w" in name:
                p.normal_(0, 0.1)
    return model.eval()


def _tokens(n: int = 40, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (2, n), generator=torch.Generator().manual_seed(seed))


def test_transformers_computes_the_same_logits(tmp_path):
    ours = _ours()
    export(GptOssStateDictAdapter, ours, TINY, tmp_path)
    hf = hf_from(tmp_path, "GptOssForCausalLM")
    assert hf.config.layer_types == ["sliding_attention", "full_attention"] * 2
    tokens = _tokens()
    assert logits_gap(ours, hf, tokens) < 1e-5
    for layer in ours.layers.values():  # the routing is exercised
        assert (layer.moe.tokens_per_expert > 0).sum() >= TINY.moe.num_experts // 2
    # the window bites: a longer one changes the logits
    wider = GptOssModel(dataclasses.replace(TINY, sliding_window=40))
    wider.load_state_dict(ours.state_dict())
    assert logits_gap(wider.eval(), hf, tokens) > 1e-3


def test_greedy_generation_matches_transformers(tmp_path):
    """Our model re-run on the growing sequence vs transformers' cached greedy decoding."""
    ours = _ours()
    export(GptOssStateDictAdapter, ours, TINY, tmp_path)
    hf = hf_from(tmp_path, "GptOssForCausalLM")
    prompt = _tokens(12, seed=2)[:1]
    mine, theirs = greedy_tokens(ours, hf, prompt)
    assert mine == theirs


def test_hf_round_trip_is_exact(tmp_path):
    """transformers' own save (gate_up_proj interleaved and transposed, biases, sinks) -> ours ->
    transformers' names, bit for bit."""
    config = GptOssStateDictAdapter(TINY).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    torch.manual_seed(5)
    hf = transformers.GptOssForCausalLM(transformers.GptOssConfig(**config))
    hf.save_pretrained(tmp_path)
    hf_state = safetensors.load_file(tmp_path / "model.safetensors")
    ours = round_trip(GptOssStateDictAdapter(TINY), GptOssModel, TINY, hf_state)
    gate_up = hf_state["model.layers.1.mlp.experts.gate_up_proj"]
    assert torch.equal(ours["layers.1.moe.experts.w1"], gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(ours["layers.1.moe.experts.w3"], gate_up[..., 1::2].transpose(1, 2))


def test_config_round_trip():
    """Our config.json -> our args, and through transformers' config class (rope_scaling and
    rope_theta become rope_parameters) -> our args; a config without ``truncate`` is read as
    transformers reads it (truncated)."""
    config = GptOssStateDictAdapter(TINY).hf_config(dtype=torch.bfloat16, bos_id=1, eos_id=2)
    assert config["rope_scaling"]["truncate"] is False
    assert GptOssStateDictAdapter.args_from_hf_config(config) == TINY
    saved = transformers.GptOssConfig(**config).to_dict()
    assert GptOssStateDictAdapter.args_from_hf_config(json.loads(json.dumps(saved))) == TINY
    old = {
        **config,
        "rope_scaling": {k: v for k, v in config["rope_scaling"].items() if k != "truncate"},
    }
    assert GptOssStateDictAdapter.args_from_hf_config(old).rope_truncate is True


@pytest.mark.parametrize(
    "change, words",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope type 'linear'"),
        ({"attention_bias": False}, "attention_bias false"),
        ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "chunked_attention"),
        ({"num_local_experts": None}, "not a gpt-oss config"),
    ],
)
def test_configs_this_model_cannot_build_are_refused(change, words):
    config = GptOssStateDictAdapter(TINY).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    config = {k: v for k, v in {**config, **change}.items() if v is not None}
    with pytest.raises(HFFormatError, match=re.escape(words)):
        GptOssStateDictAdapter.args_from_hf_config(config)


def _mxfp4(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks and scales in the published layout for a ``[E, in, out]`` weight
    (on disk ``[E, out, in / 32, 16]``), scales near the weight's magnitude."""
    e, n_in, n_out = w.shape
    blocks = torch.randint(0, 256, (e, n_out, n_in // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 125, (e, n_out, n_in // 32), generator=g, dtype=torch.uint8)
    return blocks, scales


def test_an_mxfp4_folder_imports_to_the_logits_transformers_computes_from_it(tmp_path):
    """A folder as OpenAI publishes it: every tensor as is but the two expert weights, stored as
    ``*_blocks`` and ``*_scales`` with a ``quantization_config`` (mxfp4). Our dequantization
    equals transformers' ``convert_moe_packed_tensors``, and the model read from the folder
    computes the logits transformers computes from the same folder."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    ours = _ours()
    adapter = GptOssStateDictAdapter(TINY)
    hf_state = adapter.to_hf(ours.state_dict())
    g = torch.Generator().manual_seed(7)
    for name in [n for n in hf_state if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = _mxfp4(hf_state.pop(name), g)
        hf_state[name + "_blocks"], hf_state[name + "_scales"] = blocks, scales
        theirs = mxfp4.convert_moe_packed_tensors(blocks.clone(), scales.clone())
        mine = dequantize_mxfp4({"w_blocks": blocks, "w_scales": scales})["w"]
        assert torch.equal(mine.view(torch.int16), theirs.view(torch.int16)), name
    config = adapter.hf_config(dtype=torch.bfloat16, bos_id=None, eos_id=None)
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    write_folder(str(tmp_path), hf_state, config)
    spec, args, state = read_hf_model(str(tmp_path), "test")
    assert spec.name == "gpt_oss" and args == TINY
    imported = GptOssModel(args)
    missing, unexpected = imported.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"rope_cache"}, (missing, unexpected)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path),
        dtype=torch.float32,
        attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    ).eval()
    tokens = _tokens()
    with torch.no_grad():
        got, want = imported.float().eval()(tokens), hf(tokens).logits.float()
    assert (got - want).abs().max().item() < 1e-4


# the model card (arXiv:2508.10925, Table 1): total and active parameters, in billions
PUBLISHED = {"20b": (20.91, 3.61), "120b": (116.83, 5.13)}


@pytest.mark.parametrize("flavor", list(PUBLISHED))
def test_published_parameter_counts_total_and_active(flavor):
    """Within 1% of the card; active as the card counts it: the unembedding in, the input
    embedding (a lookup) and the experts a token does not use out."""
    args = gpt_oss_configs[flavor]
    with torch.device("meta"):
        model = GptOssModel(args)
    total, _ = get_nparams_and_flops(model, args, seq_len=4096)
    active = total - inactive_params(model) - args.vocab_size * args.dim
    for ours, card in zip((total, active), PUBLISHED[flavor], strict=True):
        assert abs(ours / (card * 1e9) - 1) <= 0.01, (flavor, ours, card)


def test_flops_count_each_sliding_layer_by_its_window():
    """The attention term of a sliding layer is its mean keys per query, not the causal T / 2."""
    args = TINY
    with torch.device("meta"):
        model = GptOssModel(args)
    _, windowed = get_nparams_and_flops(model, args, seq_len=40)
    _, full = get_nparams_and_flops(model, dataclasses.replace(args, sliding_window=40), 40)
    width = args.n_heads * args.head_dim
    mean_keys = (6 * 7 / 2 + (40 - 6) * 6) / 40  # 1..6 keys for the first 6 queries, then 6
    per_sliding_layer = 6 * width * 40 - 12 * width * mean_keys
    assert full - windowed == pytest.approx(2 * per_sliding_layer, abs=1)


def test_sinks_and_every_bias_are_biases_for_the_optimizer():
    """Exempt from weight decay by default and never orthogonalized by Muon: the stacked
    experts' biases are 2-D like a matrix, the sinks 1-D like a norm."""
    from torchtitan.optim.param_groups import categories

    found = categories(GptOssModel(TINY))
    for name in (
        "layers.0.attention.sinks",
        "layers.0.attention.wqkv.bias",
        "layers.0.attention.wo.bias",
        "layers.0.moe.router.gate.bias",
        "layers.0.moe.experts.w1_bias",
        "layers.0.moe.experts.w2_bias",
        "layers.0.moe.experts.w3_bias",
    ):
        assert found[name] == "biases", name
    assert (
        found["layers.0.moe.experts.w1"] is None
        and found["layers.0.attention_norm.weight"] == "norms"
    )


def test_a_layout_a_family_cannot_use_yet_is_refused_in_one_line(monkeypatch):
    """The ``not_yet`` mechanism of a model spec (gpt-oss used it until its plans split the sinks
    and biases): preflight names the key, the family and why."""
    import dataclasses as dc

    from repo_paths import ROOT

    from torchtitan.config.parse import parse_args
    from torchtitan.errors import ConfigError
    from torchtitan.models import spec as specs
    from torchtitan.train.plan import plan_job

    why = "does not compute its frobnicator under context parallel yet"
    held = dc.replace(specs.get_model_spec("gpt_oss"), not_yet={"cp": why})
    monkeypatch.setitem(specs._REGISTRY, "gpt_oss", held)
    config = str(ROOT / "train_configs" / "gpt_oss_debug.toml")
    cfg = parse_args(["--job.config_file", config, "--parallelism.context_parallel_degree", "2"])
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=2)
    message = f"parallelism.context_parallel_degree: 2, but model gpt_oss {why}; use 1"
    assert str(e.value).endswith(message) and "\n" not in str(e.value), str(e.value)


def test_layer_types_other_than_the_alternation_are_kept_and_checked():
    kinds = ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
    args = dataclasses.replace(TINY, layer_types=kinds)
    assert args.attention_windows() == [None, 6, 6, None]
    config = GptOssStateDictAdapter(args).hf_config(dtype=torch.float32, bos_id=1, eos_id=2)
    assert config["layer_types"] == list(kinds)
    assert GptOssStateDictAdapter.args_from_hf_config(config) == args
    # the published alternation follows n_layers (a run may cut the model to fewer blocks)
    assert dataclasses.replace(TINY, n_layers=2).attention_windows() == [6, None]
    with pytest.raises(ValueError, match=r"layer_types must name 4 layers .* got 3"):
        dataclasses.replace(TINY, layer_types=kinds[:3])


def test_a_lone_scales_tensor_is_not_taken_for_mxfp4():
    w = torch.ones(3)
    blocks = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    scales = torch.full((2, 4, 1), 127, dtype=torch.uint8)
    out = dequantize_mxfp4({"a_scales": w, "b_blocks": blocks, "b_scales": scales})
    assert out.keys() == {"a_scales", "b"} and out["b"].shape == (2, 32, 4) and not out["b"].any()


# o200k_harmony's special tokens (docs/design/gpt_oss.md, section 5), as added after a BPE
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|start|>", "<|end|>", "<|message|>"]


def test_the_harmony_special_tokens_give_bos_eos_and_pad_and_stay_text_in_documents(tmp_path):
    """A folder as gpt-oss's: ``tokenizer.json`` with the harmony tokens added as special,
    ``tokenizer_config.json`` naming ``<|startoftext|>`` BOS, ``<|return|>`` EOS and
    ``<|endoftext|>`` pad, ``config.json`` the published vocabulary. BOS and EOS are those
    tokens; the embedding takes the published size; a harmony token's text inside a document is
    plain text (data cannot inject a message boundary)."""
    from hf_folders import train_tokenizer_json
    from tokenizers import AddedToken, Tokenizer

    from torchtitan.data.tokenizer import HuggingFaceTokenizer
    from torchtitan.models.gpt_oss.flavors import GPT_OSS_VOCAB_SIZE

    train_tokenizer_json(tmp_path, "bytelevel", vocab_size=400)
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    raw.add_special_tokens([AddedToken(t, special=True) for t in HARMONY])
    raw.save(str(tmp_path / "tokenizer.json"))
    tokens = {
        "bos_token": "<|startoftext|>",
        "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokens))
    config = {"model_type": "gpt_oss", "vocab_size": GPT_OSS_VOCAB_SIZE, "eos_token_id": 200002}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok = HuggingFaceTokenizer(tmp_path / "tokenizer.json")
    ids = {t: raw.token_to_id(t) for t in HARMONY}
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (
        ids["<|startoftext|>"],
        ids["<|return|>"],
        ids["<|endoftext|>"],
    )
    assert tok.n_words == GPT_OSS_VOCAB_SIZE
    encoded = tok.encode("a <|end|> b", bos=True, eos=True)
    assert encoded[0] == tok.bos_id and encoded[-1] == tok.eos_id
    assert ids["<|end|>"] not in encoded and tok.decode(encoded[1:-1]) == "a <|end|> b"
