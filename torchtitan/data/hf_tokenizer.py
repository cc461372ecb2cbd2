"""Tokenizer files that ``transformers``' ``AutoTokenizer`` loads, written next to an export.

* Llama 3 (tiktoken BPE): ``tokenizer.json`` in the ``tokenizers`` format: the file's split
  regex (Llama 3's, or Llama 4's for its 200,000 ranks), byte-level mapping, a BPE model whose
  vocabulary is the tiktoken ranks and whose merges are every ``(left, right)`` pair of tokens
  that concatenate to a token, ordered by that token's rank (so the pair merged first is the one
  tiktoken merges first), then the special tokens and a template that puts
  ``<|begin_of_text|>`` first.
* Llama 2 (SentencePiece): the ``tokenizer.model`` file itself, with a ``tokenizer_config.json``
  naming ``LlamaTokenizer``.
* A Hugging Face ``tokenizer.json`` (``HuggingFaceTokenizer``): the file itself, with the
  ``tokenizer_config.json`` (and ``special_tokens_map.json``) it came with, or a
  ``tokenizer_config.json`` naming its BOS and EOS where it came without one.

Only the standard library is used: training machines need no ``tokenizers`` package.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from torchtitan.data.tokenizer import (
    HF_SPECIAL_TOKENS_MAP,
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_FILE,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
    Tokenizer,
    read_tiktoken_ranks,
)


def byte_to_unicode() -> dict[int, str]:
    """The byte-level alphabet of GPT-2 style BPE: printable Latin-1 bytes stand for themselves,
    the other bytes for the code points from 256 upwards, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _merges(ranks: dict[bytes, int], text: Any) -> list[str]:
    """BPE merges ``"left right"`` for every split of a token into two tokens, by rank."""
    merges: list[tuple[int, str]] = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, f"{text(left)} {text(right)}"))
    merges.sort(key=lambda m: m[0])  # stable: splits of one token keep their order
    return [m for _, m in merges]


def _tiktoken_json(tok: TikTokenizer) -> dict[str, Any]:
    ranks = read_tiktoken_ranks(tok.path)
    to_str = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(to_str[b] for b in token)

    bos = "<|begin_of_text|>"
    specials = tok.special_tokens
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for t, i in sorted(specials.items(), key=lambda kv: kv[1])
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": tok.split_pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [specials[bos]], "tokens": [bos]}},
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,  # a piece that is a token is that token, as in tiktoken
            "vocab": {text(t): r for t, r in ranks.items()},
            "merges": _merges(ranks, text),
        },
    }


def write_tokenizer_files(path: str, tok: Tokenizer, model_max_length: int) -> list[str]:
    """Write the files ``AutoTokenizer.from_pretrained(path)`` needs; returns their names."""
    os.makedirs(path, exist_ok=True)
    if isinstance(tok, TikTokenizer):
        with open(os.path.join(path, "tokenizer.json"), "w") as f:
            json.dump(_tiktoken_json(tok), f, ensure_ascii=False)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|end_of_text|>",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
        }
        files = ["tokenizer.json"]
    elif isinstance(tok, SentencePieceTokenizer):
        shutil.copyfile(tok.path, os.path.join(path, "tokenizer.model"))
        sp = tok._model
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": sp.id_to_piece(tok.bos_id),
            "eos_token": sp.id_to_piece(tok.eos_id),
            "unk_token": sp.id_to_piece(sp.unk_id()),
            "add_bos_token": True,
            "add_eos_token": False,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
            "legacy": True,
        }
        files = ["tokenizer.model"]
    elif isinstance(tok, HuggingFaceTokenizer):
        source = os.path.dirname(os.path.abspath(tok.path))
        shutil.copyfile(tok.path, os.path.join(path, HF_TOKENIZER_FILE))
        files = [HF_TOKENIZER_FILE]
        if os.path.isfile(os.path.join(source, HF_SPECIAL_TOKENS_MAP)):
            shutil.copyfile(
                os.path.join(source, HF_SPECIAL_TOKENS_MAP),
                os.path.join(path, HF_SPECIAL_TOKENS_MAP),
            )
            files.append(HF_SPECIAL_TOKENS_MAP)
        config = tok.tokenizer_config()
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.setdefault("model_max_length", model_max_length)
        config.setdefault("clean_up_tokenization_spaces", False)
        # BOS / EOS may have come from config.json: name them here, where AutoTokenizer looks
        for name, token_id in (("bos", tok.bos_id), ("eos", tok.eos_id)):
            if not config.get(f"{name}_token"):
                config[f"{name}_token"] = tok.id_to_token(token_id)
    else:
        raise TypeError(f"no Hugging Face tokenizer files for {type(tok).__name__}")
    with open(os.path.join(path, HF_TOKENIZER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
    return [*files, HF_TOKENIZER_CONFIG]
