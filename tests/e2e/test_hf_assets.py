"""Hugging Face asset folders through real processes: scripts/download_hf_assets.py run offline
is one line on stderr, ``scripts/generate.py --checkpoint FOLDER`` generates what transformers
generates, and training starts from a whole folder (``model.hf_assets_path``). The in-process
checks are in tests/unit/scripts/test_hf_assets.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from download_scripts import check_offline_download_is_one_line
from hf_folders import train_tokenizer_json, write_model_folder
from repo_paths import ROOT

from torchtitan.data.tokenizer import HuggingFaceTokenizer, build_tokenizer

REPO = "meta-llama/Llama-3.1-8B"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    """A Hub-like Llama folder of the debug flavor with a trained byte-level tokenizer."""
    bytelevel = tmp_path_factory.mktemp("tokenizers") / "bytelevel"
    train_tokenizer_json(bytelevel, "bytelevel")
    return write_model_folder(bytelevel, tmp_path_factory.mktemp("Llama-debug"))


def test_download_offline_subprocess(tmp_path):
    check_offline_download_is_one_line("download_hf_assets.py", REPO, tmp_path)


@pytest.mark.slow
def test_generate_from_a_folder_without_tokenizer_flag(hf_folder):
    """generate.py --checkpoint FOLDER takes the folder's tokenizer; transformers, on the same
    folder, encodes the prompt alike and generates the same tokens."""
    transformers = pytest.importorskip("transformers")
    import torch

    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "generate.py"),
            "--checkpoint",
            str(hf_folder),
            "--prompt",
            "def main(",
            "--max_new_tokens",
            "12",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    assert hf_tok("def main(")["input_ids"] == result["prompt_ids"]
    assert hf_tok.decode(result["output_ids"]) == result["text"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_folder)).eval()
    prompt = torch.tensor([result["prompt_ids"]])
    with torch.no_grad():
        generated = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = generated[0, prompt.shape[1] :].tolist()
    assert result["output_ids"] and result["output_ids"] == expected[: len(result["output_ids"])]


@pytest.mark.slow
def test_training_starts_from_a_hf_assets_folder(pools, hf_folder, tmp_path):
    """--model.hf_assets_path FOLDER --checkpoint.initial_load_in_hf: the tokenizer (vocabulary
    1000, not the test tokenizer's 2256) and the weights come from the folder. With a learning
    rate of ~0 the run's own export gives the folder's weights back bit for bit, and its tokenizer
    files."""
    import torch
    from launcher import pooled

    from torchtitan.checkpoint.hf_files import read_folder

    out = pooled(
        pools,
        tmp_path,
        "--model.hf_assets_path",
        str(hf_folder),
        "--checkpoint.enable",
        "--checkpoint.initial_load_in_hf",
        "--checkpoint.last_save_in_hf",
        "--training.steps",
        "1",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--optimizer.lr",
        "1e-30",
        "--optimizer.weight_decay",
        "0",
        "--debug.seed",
        "42",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"Loaded Hugging Face weights from {hf_folder}" in out.stdout
    assert "vocab 1000" in out.stdout
    export = tmp_path / "out" / "checkpoint" / "step-1-hf"
    again, original = read_folder(str(export)), read_folder(str(hf_folder))
    assert again.keys() == original.keys()
    for k in original:
        assert torch.equal(again[k], original[k]), k
    exported = build_tokenizer(export)
    assert isinstance(exported, HuggingFaceTokenizer)
    assert (export / "tokenizer.json").read_bytes() == (hf_folder / "tokenizer.json").read_bytes()
