"""Tokenizers with a published model's vocabulary size, made from the small test tokenizers.

The upstream configs name published flavors (Llama 3 8B: 128,256 tokens; Llama 2 7B: 32,000), and
the config check refuses a tokenizer of another size. These pad the test tokenizers with tokens no
text produces, so the check sees the real sizes without the real (gated) tokenizer files.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

from repo_paths import TOKENIZER_ASSETS as ASSETS

LLAMA3_VOCAB, LLAMA2_VOCAB, LLAMA4_VOCAB = 128_256, 32_000, 202_048


def _padded_tiktoken(dest: Path, ranks: int) -> Path:
    """The test tiktoken file padded to ``ranks`` ranks."""
    lines = (ASSETS / "tiktoken.model").read_bytes().splitlines()
    pad = [
        base64.b64encode(b"\x00\x01pad%06d" % i) + b" " + str(len(lines) + i).encode()
        for i in range(ranks - len(lines))
    ]
    dest.write_bytes(b"\n".join(lines + pad) + b"\n")
    return dest


def llama3_sized_tiktoken(dest: Path) -> Path:
    """The test tiktoken file padded to 128,000 ranks (+ 256 special tokens = Llama 3's size)."""
    return _padded_tiktoken(dest, LLAMA3_VOCAB - 256)


def llama4_sized_tiktoken(dest: Path) -> Path:
    """The test tiktoken file padded to 200,000 ranks, as Meta's Llama 4 tokenizer.model (+ its
    2,048 special tokens = Llama 4's 202,048)."""
    return _padded_tiktoken(dest, LLAMA4_VOCAB - 2048)


def llama2_sized_sentencepiece(dest: Path) -> Path:
    """The test SentencePiece model padded to 32,000 pieces."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString((ASSETS / "sentencepiece.model").read_bytes())
    for i in range(LLAMA2_VOCAB - len(model.pieces)):
        piece = model.pieces.add()
        piece.piece, piece.score = f"\u2581pad{i:05d}\u2581", -1e9
    dest.write_bytes(model.SerializeToString())
    return dest


def hf_assets_folder(dest: Path, vocab_size: int, text_config_vocab: int | None = None) -> Path:
    """A Hugging Face model folder whose tokenizer.json has ``vocab_size`` tokens (word level);
    with ``text_config_vocab`` also a multimodal config.json (as Llama 4's) whose language model's
    ``text_config.vocab_size`` is that (its embedding padded beyond the tokenizer's ids)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    dest.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(dest / "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    if text_config_vocab is not None:
        model = {
            "architectures": ["Llama4ForConditionalGeneration"],
            "model_type": "llama4",
            "text_config": {"model_type": "llama4_text", "vocab_size": text_config_vocab},
            "vision_config": {"model_type": "llama4_vision_model"},
        }
        (dest / "config.json").write_text(json.dumps(model))
    return dest
