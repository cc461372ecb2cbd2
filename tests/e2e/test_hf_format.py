"""Hugging Face interop through real processes: the export of an FSDP training run gives
transformers the same logits and starts a pipelined run whose export is bit for bit the same; the
conversion scripts agree with each other; generate.py's greedy tokens are transformers', and its
seeded sampling repeats. The in-process checks of the conversion and the files are in
tests/unit/checkpoint/test_hf_format.py."""

from __future__ import annotations

import json

import pytest
import torch
from hf_folders import debug_model_args
from launcher import pooled
from repo_paths import ROOT, TIKTOKEN_PATH

from torchtitan.checkpoint.hf_files import read_folder
from torchtitan.models.llama.model import Transformer

transformers = pytest.importorskip("transformers")


def _launch(pools, tmp_path, ngpu, *args):
    """A run in the session's warm pool of ``ngpu`` ranks (its rank-0 log as stdout)."""
    return pooled(
        pools,
        tmp_path,
        "--training.seq_len",
        "64",
        "--training.global_batch_size",
        "8",
        "--debug.seed",
        "42",
        "--checkpoint.enable",
        *args,
        ngpu=ngpu,
    )


@pytest.fixture(scope="module")
def trained(pools, tmp_path_factory):
    """FSDP 2 trains the debug model 4 steps: DCP step-4 and its export step-4-hf."""
    first = tmp_path_factory.mktemp("first")
    _launch(
        pools,
        first,
        2,
        "--training.steps",
        "4",
        "--training.local_batch_size",
        "4",
        "--checkpoint.interval",
        "4",
        "--checkpoint.last_save_in_hf",
    )
    return first / "out" / "checkpoint"


@pytest.mark.slow
def test_export_after_training_and_import_into_another_layout(pools, tmp_path, trained):
    """The export of an FSDP 2 run (last_save_in_hf): transformers computes the logits of the
    trained weights (read back from the DCP checkpoint). A PP 2 job then starts from that
    export with learning rate ~0 and exports again: the weights come back bit for bit."""
    import torch.distributed.checkpoint as dcp

    export = trained / "step-4-hf"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["vocab_size"] == 2256

    ours = Transformer(debug_model_args(2256))
    state = {"model": ours.state_dict()}
    dcp.load(state, checkpoint_id=str(trained / "step-4"))
    ours.load_state_dict(state["model"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export)).eval()
    tokens = torch.randint(0, 2256, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (hf(tokens).logits - ours.eval()(tokens)).abs().max().item() < 1e-4

    second = tmp_path / "second"
    second.mkdir()
    out = _launch(
        pools,
        second,
        2,
        "--training.steps",
        "1",
        "--training.local_batch_size",
        "8",
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_microbatch_size",
        "4",
        "--optimizer.lr",
        "1e-30",
        "--optimizer.weight_decay",
        "0",
        "--checkpoint.initial_load_path",
        str(export),
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
    )
    assert f"Loaded Hugging Face weights from {export}" in out.stdout
    again = read_folder(str(second / "out" / "checkpoint" / "step-1-hf"))
    original = read_folder(str(export))
    assert again.keys() == original.keys()
    for k in original:
        assert torch.equal(again[k], original[k]), k


def _script(name: str, *args: str) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_conversion_scripts_agree_with_each_other(tmp_path, trained):
    from torchtitan.checkpoint import read_model_weights

    weights = read_model_weights(str(trained / "step-4"))
    _script(
        "convert_dcp_to_hf.py",
        str(trained / "step-4"),
        str(tmp_path / "hf"),
        "--flavor",
        "debugmodel",
        "--max_shard_gb",
        "0.005",
    )
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()  # sharded: 5 MB shards
    exported = read_folder(str(trained / "step-4-hf"))
    converted = read_folder(str(tmp_path / "hf"))
    assert exported.keys() == converted.keys()
    assert all(torch.equal(exported[k], converted[k]) for k in exported)

    _script("convert_hf_to_dcp.py", str(tmp_path / "hf"), str(tmp_path / "dcp"))
    _script("convert_dcp_to_torch.py", str(tmp_path / "dcp"), str(tmp_path / "weights.pt"))
    back = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert back.keys() == weights.keys()
    assert all(torch.equal(back[k], weights[k]) for k in weights)


@pytest.mark.slow
def test_greedy_generation_equals_transformers(trained):
    tokenizer = str(TIKTOKEN_PATH)
    common = ["--tokenizer", tokenizer, "--prompt", "def main(", "--max_new_tokens", "12", "--json"]
    from_hf_export = json.loads(
        _script("generate.py", "--checkpoint", str(trained / "step-4-hf"), *common).splitlines()[-1]
    )
    from_dcp = json.loads(
        _script(
            "generate.py",
            "--checkpoint",
            str(trained / "step-4"),
            "--flavor",
            "debugmodel",
            *common,
        ).splitlines()[-1]
    )
    assert from_dcp["output_ids"] == from_hf_export["output_ids"]

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(trained / "step-4-hf"))
    assert hf_tok("def main(")["input_ids"] == from_hf_export["prompt_ids"]
    assert hf_tok.decode(from_hf_export["output_ids"]) == from_hf_export["text"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(trained / "step-4-hf")).eval()
    prompt = torch.tensor([from_hf_export["prompt_ids"]])
    with torch.no_grad():
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = out[0, prompt.shape[1] :].tolist()
    assert (
        from_hf_export["output_ids"]
        and from_hf_export["output_ids"] == expected[: len(from_hf_export["output_ids"])]
    )


@pytest.mark.slow
def test_generate_samples_reproducibly_with_a_seed(trained):
    """generate.py's sampling options from the command line: the same seed gives the same
    tokens, another seed others, and top-k 1 gives the greedy tokens."""
    common = [
        "--checkpoint",
        str(trained / "step-4-hf"),
        "--tokenizer",
        str(TIKTOKEN_PATH),
        "--prompt",
        "def main(",
        "--max_new_tokens",
        "12",
        "--json",
    ]

    def generate(*options: str) -> dict:
        return json.loads(_script("generate.py", *common, *options).splitlines()[-1])

    greedy = generate()
    sampled = generate("--temperature", "1.0", "--seed", "11")
    assert sampled == generate("--temperature", "1.0", "--seed", "11") and sampled["seed"] == 11
    assert sampled["output_ids"] != generate("--temperature", "1.0", "--seed", "12")["output_ids"]
    assert sampled["output_ids"] != greedy["output_ids"]
    top1 = generate("--temperature", "1.0", "--top_k", "1", "--seed", "5")
    assert top1["output_ids"] == greedy["output_ids"] and "seed" not in greedy
