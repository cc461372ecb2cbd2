"""Hugging Face model folders for the tests, built offline: ``tokenizer.json`` files trained with
the ``tokenizers`` library on the offline corpus (Llama 3 and Llama 2 styles), and a Hub-like Llama
folder of the debug flavor (tokenizer, config.json, model.safetensors). Shared by
tests/unit/scripts/test_hf_assets.py and tests/e2e/test_hf_assets.py (and the debug model's arguments by
tests/e2e/test_hf_format.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path


def corpus() -> list[str]:
    # the language-reference half of the offline corpus: real prose, read in milliseconds
    from torchtitan.data.pydoc_corpus import _topic_documents

    return _topic_documents()


def train_tokenizer_json(folder: Path, style: str, vocab_size: int = 1000) -> None:
    """Train a ``tokenizer.json`` with ``tokenizers`` and write it with the
    ``tokenizer_config.json`` of a Hub folder: ``bytelevel`` is built like Llama 3's (split regex,
    byte-level BPE, a post-processor that adds BOS), ``metaspace`` like Llama 2's (``▁`` for
    spaces, byte fallback, an unknown token)."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    from torchtitan.data.tokenizer import LLAMA3_SPLIT_PATTERN

    if style == "bytelevel":
        bos, eos, pad = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
        tok = Tokenizer(models.BPE(ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[bos, eos, pad],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    else:
        bos, eos, pad = "<s>", "</s>", None
        tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<unk>", bos, eos] + [f"<0x{b:02X}>" for b in range(256)],
            show_progress=False,
        )
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        # the form transformers writes: an AddedToken as a dict
        "eos_token": {
            "__type": "AddedToken",
            "content": eos,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    if pad:
        config["pad_token"] = pad
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def copy_files(folder: Path, dest: Path, *names: str) -> Path:
    """Copy the files ``names`` of ``folder`` into ``dest`` (made if missing); ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copy(folder / name, dest / name)
    return dest


def debug_model_args(vocab_size: int, max_seq_len: int = 64):
    """The llama3 debug flavor's model arguments with this vocabulary and sequence length."""
    from torchtitan.models.spec import get_model_args

    return dataclasses.replace(
        get_model_args("llama3", "debugmodel"), vocab_size=vocab_size, max_seq_len=max_seq_len
    )


def write_model_folder(bytelevel: Path, folder: Path) -> Path:
    """A Hub-like Llama folder: the trained byte-level tokenizer in ``bytelevel``
    (tokenizer.json, tokenizer_config.json), config.json and model.safetensors of a debug-flavor
    model whose vocabulary is that tokenizer's."""
    import torch

    from torchtitan.checkpoint.hf_files import write_folder
    from torchtitan.data.tokenizer import build_tokenizer
    from torchtitan.models.llama.hf_adapter import LlamaStateDictAdapter
    from torchtitan.models.llama.model import Transformer

    copy_files(bytelevel, folder, "tokenizer.json", "tokenizer_config.json")
    tok = build_tokenizer(folder)
    args = debug_model_args(tok.n_words)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    adapter = LlamaStateDictAdapter(args)
    config = adapter.hf_config(dtype=torch.float32, bos_id=tok.bos_id, eos_id=tok.eos_id)
    write_folder(str(folder), adapter.to_hf(model.state_dict()), config)
    return folder
