"""Hugging Face interop: this model's weights in transformers' Llama layout give transformers'
LlamaForCausalLM the same logits, the conversion round-trips exactly, the files are what
from_pretrained reads (single and sharded), mismatches are listed in one error, and the exported
tokenizer files load in AutoTokenizer. Exports from training runs, the conversion scripts and
generate.py are in tests/e2e/test_hf_format.py."""

from __future__ import annotations

import json

import pytest
import torch
from hf_oracle import logits_gap
from repo_paths import TOKENIZER_ASSETS

from torchtitan.checkpoint.hf_files import read_folder, write_folder
from torchtitan.errors import HFFormatError
from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
from torchtitan.models.llama.model import ModelArgs, Transformer


def to_hf(state, args):
    return LlamaStateDictAdapter(args).to_hf(state)


def from_hf(hf_state, args, expected):
    return LlamaStateDictAdapter(args).from_hf(hf_state, expected)


def hf_config(args, **kwargs):
    return LlamaStateDictAdapter(args).hf_config(**kwargs)


transformers = pytest.importorskip("transformers")

FLAVORS = {
    "gqa": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=96,
        max_seq_len=32,
        multiple_of=32,
        rope_theta=500000.0,
    ),
    "tied_scaled_rope": ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=2,
        vocab_size=96,
        max_seq_len=32,
        multiple_of=32,
        tie_word_embeddings=True,
        use_scaled_rope=True,
        rope_original_max_seq_len=16,
        rope_scale_factor=4.0,
    ),
    "mha": ModelArgs(
        dim=48, n_layers=1, n_heads=3, vocab_size=80, max_seq_len=32, multiple_of=16, norm_eps=1e-6
    ),
}


def _ours(args: ModelArgs) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():  # norms away from 1 so that a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model.eval()


def _hf_model(args: ModelArgs, state: dict) -> torch.nn.Module:
    config = transformers.LlamaConfig(**hf_config(args, dtype=torch.float32, bos_id=1, eos_id=2))
    model = transformers.LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_transformers_computes_the_same_logits(flavor):
    args = FLAVORS[flavor]
    ours = _ours(args)
    hf = _hf_model(args, to_hf(ours.state_dict(), args))
    tokens = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    assert logits_gap(ours, hf, tokens) < 1e-4


@pytest.mark.parametrize("flavor", list(FLAVORS))
def test_round_trip_is_exact(flavor):
    args = FLAVORS[flavor]
    state = _ours(args).state_dict()
    shapes = {k: v.shape for k, v in state.items()}
    back = from_hf(to_hf(state, args), args, shapes)
    assert back.keys() == state.keys()
    for k in state:
        assert torch.equal(back[k], state[k]), k


@pytest.mark.parametrize("max_shard_bytes", [1 << 30, 20_000])
def test_folders_single_and_sharded_load_in_transformers(tmp_path, max_shard_bytes):
    args = FLAVORS["gqa"]
    ours = _ours(args)
    hf_state = to_hf(ours.state_dict(), args)
    config = hf_config(args, dtype=torch.float32, bos_id=1, eos_id=2)
    files = write_folder(str(tmp_path), hf_state, config, max_shard_bytes=max_shard_bytes)
    assert (len(files) > 1) == (max_shard_bytes == 20_000)
    if len(files) > 1:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(hf_state)
    loaded = read_folder(str(tmp_path))
    assert all(torch.equal(loaded[k], hf_state[k]) for k in hf_state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens = torch.arange(20).view(1, 20) % args.vocab_size
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max().item() < 1e-4


def test_mismatches_are_listed_in_one_error():
    args = FLAVORS["gqa"]
    state = _ours(args).state_dict()
    shapes = {k: v.shape for k, v in state.items()}
    hf_state = to_hf(state, args)
    del hf_state["model.layers.1.mlp.up_proj.weight"]
    hf_state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    hf_state["model.layers.0.self_attn.q_norm.weight"] = torch.zeros(3)
    with pytest.raises(HFFormatError) as e:
        from_hf(hf_state, args, shapes)
    msg = str(e.value)
    assert "\n" not in msg
    assert "1 missing: model.layers.1.mlp.up_proj.weight" in msg
    assert "1 unexpected: model.layers.0.self_attn.q_norm.weight" in msg
    assert "1 shape: model.layers.0.self_attn.q_proj.weight (3, 3) vs (64, 64)" in msg


def test_a_folder_without_weights_is_refused(tmp_path):
    with pytest.raises(HFFormatError, match="neither model.safetensors nor"):
        read_folder(str(tmp_path))


# ----------------------------------------------------------------------------- tokenizer files


TEXTS = [
    "def main():\n    return 42  # héllo wörld",
    "Hello, world! 12345 6789",
    "emoji 🤖 and 中文字符\n\n\ttabs",
    "x" * 300,
    "",
]


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece"])
def test_exported_tokenizer_files_load_in_autotokenizer(tmp_path, kind):
    from torchtitan.data.hf_tokenizer import write_tokenizer_files
    from torchtitan.data.tokenizer import build_tokenizer

    ours = build_tokenizer(TOKENIZER_ASSETS / f"{kind}.model")
    write_tokenizer_files(str(tmp_path), ours, 2048)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert hf(text)["input_ids"] == ours.encode(text, bos=True, eos=False), text
        ids = ours.encode(text, bos=False, eos=False)
        assert hf.decode(ids) == ours.decode(ids), text
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
