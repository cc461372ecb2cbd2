"""Tokenizers: Llama 3 tiktoken BPE, Llama 2 SentencePiece and Hugging Face ``tokenizer.json``.

``build_tokenizer(path)`` looks at what ``path`` holds and returns a :class:`TikTokenizer` (a
tiktoken BPE file: UTF-8 lines ``<base64 token bytes> <rank>``, as Llama 3's
``original/tokenizer.model``), a :class:`SentencePieceTokenizer` (a SentencePiece model proto, as
Llama 2's ``tokenizer.model``) or a :class:`HuggingFaceTokenizer` (a ``tokenizer.json`` read by the
``tokenizers`` library). ``path`` may also be a folder as the Hugging Face Hub ships a model (see
:func:`tokenizer_file_in`). :func:`tokenizer_source` says which path the config selects.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import os
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any

from torchtitan.errors import ConfigError

__all__ = [
    "Tokenizer",
    "TikTokenizer",
    "SentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "build_tokenizer",
    "tokenizer_file_in",
    "tokenizer_source",
    "resolve_tokenizer_path",
    "LLAMA3_SPLIT_PATTERN",
    "LLAMA4_SPLIT_PATTERN",
    "llama3_special_tokens",
    "llama4_special_tokens",
    "tiktoken_layout",
]

# The Llama 3 pre-tokenizer: contractions, words (with one leading non-letter), numbers of up to
# three digits, punctuation runs, newlines and other whitespace.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

NUM_SPECIAL_TOKENS = 256

# Llama 4's tiktoken file (Meta's tokenizer.model of Llama-4-Scout / Maverick) holds 200,000 ranks,
# followed by 2,048 special tokens (202,048 = the text_config.vocab_size of its config.json), and
# splits text with an o200k-style pattern (words keep their case run and an optional contraction).
# Source: meta-llama/llama-models, models/llama4/tokenizer.py (num_reserved_special_tokens = 2048,
# O200K_PATTERN); <|begin_of_text|> and <|end_of_text|> are its first two special tokens.
LLAMA4_BASE_RANKS = 200_000
LLAMA4_NUM_SPECIAL_TOKENS = 2048
LLAMA4_SPLIT_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# tiktoken gets very slow (quadratic) on huge pieces and its regex on huge whitespace runs, so
# encode() works on chunks of at most this many characters ...
MAX_CHUNK_CHARS = 400_000
# ... each further cut so that no run of consecutive whitespace (or non-whitespace) is longer.
MAX_RUN_CHARS = 25_000

_TOKENIZER_HELP = (
    "give a Hugging Face model folder or its tokenizer.json, the Llama 3 original/tokenizer.model "
    "or a Llama 2 tokenizer.model (see scripts/download_hf_assets.py, "
    "scripts/download_tokenizer.py)"
)


def llama3_special_tokens(num_special_tokens: int = NUM_SPECIAL_TOKENS) -> list[str]:
    """The Llama 3 special tokens in id order (they follow the mergeable ranks)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    reserved = [
        f"<|reserved_special_token_{2 + i}|>" for i in range(num_special_tokens - len(named))
    ]
    return named + reserved


def llama4_special_tokens() -> list[str]:
    """Llama 4's 2,048 special tokens in id order: BOS, EOS and the three fill-in-the-middle
    tokens by their names; the other 2,043 (Meta names the chat, vision and reasoning tokens
    among them, ids 200,005-201,143) are reserved placeholders here, as pretraining uses only
    BOS and EOS."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
    ]
    reserved = [
        f"<|reserved_special_token_{i}|>" for i in range(LLAMA4_NUM_SPECIAL_TOKENS - len(named))
    ]
    return named + reserved


def tiktoken_layout(num_base: int) -> tuple[list[str], str]:
    """The special tokens that follow a tiktoken file of ``num_base`` ranks, and its split
    pattern: Llama 4's (2,048 tokens, the o200k-style pattern) after Llama 4's 200,000 ranks,
    else Llama 3's (256 tokens; Llama 3's file has 128,000 ranks)."""
    if num_base == LLAMA4_BASE_RANKS:
        return llama4_special_tokens(), LLAMA4_SPLIT_PATTERN
    return llama3_special_tokens(), LLAMA3_SPLIT_PATTERN


class Tokenizer(ABC):
    """Text <-> token ids. ``n_words`` is the vocabulary size the model's embedding needs.

    Subclasses set ``_model`` (whose ``decode`` takes a list of ints), ``_n_words``, ``_bos_id``,
    ``_eos_id`` and ``_pad_id`` (-1 when the tokenizer has none), and implement ``encode``.
    """

    _model: Any
    path: str
    _n_words: int
    _bos_id: int
    _eos_id: int
    _pad_id: int

    @abstractmethod
    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of ``text``, with ``bos_id`` prepended and/or ``eos_id`` appended if asked."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""
        return self._model.decode([int(i) for i in ids])

    @property
    def n_words(self) -> int:
        """Vocabulary size, special tokens included."""
        return self._n_words

    @property
    def bos_id(self) -> int:
        """Id of the beginning-of-sequence token."""
        return self._bos_id

    @property
    def eos_id(self) -> int:
        """Id of the end-of-sequence token."""
        return self._eos_id

    @property
    def pad_id(self) -> int:
        """Id of the padding token, -1 if the tokenizer has none."""
        return self._pad_id

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this tokenizer in a pretokenized corpus's manifest: its kind, the
        SHA-256 of its file, its vocabulary size and BOS/EOS ids."""
        import hashlib

        with open(self.path, "rb") as f:  # a tokenizer file is small (_MAX_TOKENIZER_BYTES)
            digest = hashlib.sha256(f.read()).hexdigest()
        return {
            "kind": type(self).__name__,
            "file": os.path.basename(self.path),
            "sha256": digest,
            "vocab_size": self.n_words,
            "bos_id": self.bos_id,
            "eos_id": self.eos_id,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(n_words={self.n_words}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id})"
        )


@functools.lru_cache(maxsize=8)
def _long_run_re(max_run: int) -> re.Pattern[str]:
    # The lookbehinds anchor each match at the start of a run, which keeps the scan linear.
    n = max_run + 1
    return re.compile(rf"(?<!\s)\s{{{n},}}|(?<!\S)\S{{{n},}}")


def _split_long_runs(text: str, max_run: int) -> Iterator[str]:
    """Cut ``text`` so that no piece holds more than ``max_run`` consecutive whitespace or
    non-whitespace characters. Cuts fall only inside runs that are too long, every ``max_run``
    characters from the run's start; joined, the pieces give back ``text``."""
    start = 0
    for match in _long_run_re(max_run).finditer(text):
        run_start, run_end = match.span()
        for cut in range(run_start + max_run, run_end, max_run):
            yield text[start:cut]
            start = cut
    if start < len(text):
        yield text[start:]


def _encode_chunks(text: str) -> Iterator[str]:
    """Pieces of ``text`` that tiktoken encodes fast: chunks of at most ``MAX_CHUNK_CHARS``
    characters, each with no run over ``MAX_RUN_CHARS``."""
    for i in range(0, len(text), MAX_CHUNK_CHARS):
        yield from _split_long_runs(text[i : i + MAX_CHUNK_CHARS], MAX_RUN_CHARS)


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """The mergeable ranks of a tiktoken BPE file (lines ``<base64 token> <rank>``), read from
    the file itself. tiktoken's own ``load_tiktoken_bpe`` caches what it reads under a key made of
    the path string, so a path that later holds another file would be read back stale.
    ValueError naming the 1-based line of a malformed or repeated entry."""
    with open(path, "rb") as f:
        data = f.read()
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (binascii.Error, ValueError):
            shown = line[:60].decode("utf-8", "replace")
            raise ValueError(f"line {n} {shown!r} is not '<base64 token> <rank>'") from None
        if token in ranks:
            raise ValueError(f"line {n}: token {token!r} is listed twice")
        ranks[token] = rank
    return ranks


class TikTokenizer(Tokenizer):
    """Llama 3 tokenizer: a tiktoken BPE file plus the 256 Llama 3 special tokens after it; a
    file of Llama 4's 200,000 ranks gets Llama 4's 2,048 and its split pattern
    (:func:`tiktoken_layout`).

    Special-token text inside a document (``"<|end_of_text|>"``) is encoded as ordinary text, so
    data cannot inject control tokens; ``bos``/``eos`` are the only way to get them.
    """

    def __init__(self, path: str | os.PathLike):
        import tiktoken

        self.path = os.fspath(path)
        mergeable_ranks = read_tiktoken_ranks(self.path)
        num_base = len(mergeable_ranks)
        ranks = set(mergeable_ranks.values())
        if len(ranks) != num_base or min(ranks, default=0) != 0 or max(ranks) != num_base - 1:
            raise ValueError("ranks are not 0..N-1, each given to exactly one token")
        special, self.split_pattern = tiktoken_layout(num_base)
        self._special_tokens = {token: num_base + i for i, token in enumerate(special)}
        self._model = tiktoken.Encoding(
            name=os.path.basename(self.path),
            pat_str=self.split_pattern,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self._special_tokens,
        )
        self._n_words = self._model.n_vocab
        self._bos_id = self._special_tokens["<|begin_of_text|>"]
        self._eos_id = self._special_tokens["<|end_of_text|>"]
        self._pad_id = -1

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special-token text -> id."""
        return dict(self._special_tokens)

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids: list[int] = [self._bos_id] if bos else []
        for chunk in _encode_chunks(text):
            ids.extend(self._model.encode(chunk, allowed_special=set(), disallowed_special=()))
        if eos:
            ids.append(self._eos_id)
        return ids

    def encode_rendered(self, text: str) -> tuple[list[int], list[int]]:
        """Ids of a chat template's rendering, its special-token text read as special tokens
        (tiktoken's ``allowed_special="all"``), and each token's ``(start, end)`` characters."""
        ids: list[int] = []
        for piece in self._special_re.split(text):
            special = self._special_tokens.get(piece)
            if special is not None:
                ids.append(special)
            elif piece:
                ids.extend(self.encode(piece, bos=False, eos=False))
        return ids, _char_spans(text, [len(self._model.decode_single_token_bytes(i)) for i in ids])

    def template_variables(self) -> dict[str, str]:
        """The special-token texts a chat template is rendered with."""
        return {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}

    @functools.cached_property
    def _special_re(self) -> re.Pattern[str]:
        alternatives = sorted(self._special_tokens, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")


def _char_spans(text: str, token_bytes: list[int]) -> list[tuple[int, int]]:
    """Each token's ``(start, end)`` characters, from the UTF-8 byte lengths of the tokens of
    ``text``: a token that starts or ends inside a character covers that character."""
    import numpy as np

    char_bytes = np.fromiter((len(c.encode()) for c in text), dtype=np.int64, count=len(text))
    char_ends = np.cumsum(char_bytes)
    ends = np.cumsum(np.asarray(token_bytes, dtype=np.int64))
    starts = ends - np.asarray(token_bytes, dtype=np.int64)
    first = np.searchsorted(char_ends, starts, side="right")
    last = np.searchsorted(char_ends, ends, side="left") + 1
    return list(zip(first.tolist(), last.tolist(), strict=True))


class SentencePieceTokenizer(Tokenizer):
    """Llama 2 tokenizer: a SentencePiece model; bos/eos/pad ids come from the model."""

    def __init__(self, path: str | os.PathLike):
        import sentencepiece

        self.path = os.fspath(path)
        self._model = sentencepiece.SentencePieceProcessor(model_file=self.path)
        self._n_words = self._model.vocab_size()
        self._bos_id = self._model.bos_id()
        self._eos_id = self._model.eos_id()
        self._pad_id = self._model.pad_id()

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids: list[int] = [self._bos_id] if bos else []
        ids.extend(self._model.encode(text, out_type=int))
        if eos:
            ids.append(self._eos_id)
        return ids


HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS_MAP = "special_tokens_map.json"
HF_MODEL_CONFIG = "config.json"


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json``, run by the ``tokenizers`` library as written.

    The ids are those of ``transformers.AutoTokenizer`` on the same folder called with
    ``add_special_tokens=False`` (the file's post-processor would add its own BOS; ``bos``/``eos``
    here add ours), with one deliberate difference, as in :class:`TikTokenizer`: special-token
    text inside a document (``"<|end_of_text|>"``) is encoded as ordinary text, so data cannot
    inject control tokens (``AutoTokenizer``'s ``split_special_tokens=True``).

    BOS / EOS / pad come from the files next to ``tokenizer.json``: ``bos_token`` / ``eos_token``
    / ``pad_token`` of ``tokenizer_config.json`` (a string, or a dict whose ``content`` is the
    token), else of ``special_tokens_map.json``, else ``bos_token_id`` / ``eos_token_id`` /
    ``pad_token_id`` of ``config.json`` (the first id of a list). A BOS and an EOS are required;
    a missing pad is -1.

    ``n_words``: one more than the largest id (added tokens included), or the ``vocab_size`` of
    the folder's ``config.json`` (its ``text_config``'s in a multimodal one, as Llama 4's) where
    that is larger (models pad their embedding), so that the model built from it takes the
    folder's weights.
    """

    def __init__(self, path: str | os.PathLike):
        try:
            from tokenizers import Tokenizer as _HFTokenizerModel
        except ImportError:
            raise ValueError(
                "the tokenizers package is not installed (pip install 'tokenizers>=0.19')"
            ) from None

        self.path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(self.path))
        self._model = _HFTokenizerModel.from_file(self.path)
        # special-token text in a document is plain text (see the class docstring)
        self._model.encode_special_tokens = True
        self._tokenizer_config = tokenizer_config = _read_json_object(
            os.path.join(folder, HF_TOKENIZER_CONFIG)
        )
        special_tokens_map = _read_json_object(os.path.join(folder, HF_SPECIAL_TOKENS_MAP))
        self._special_tokens_map = special_tokens_map
        model_config = _read_json_object(os.path.join(folder, HF_MODEL_CONFIG))

        vocab = self._model.get_vocab(with_added_tokens=True)
        n_words = max(
            self._model.get_vocab_size(with_added_tokens=True),
            max(vocab.values(), default=-1) + 1,
        )
        config_vocab = _config_vocab_size(model_config)
        if isinstance(config_vocab, int) and not isinstance(config_vocab, bool):
            n_words = max(n_words, config_vocab)
        self._n_words = n_words

        def special(name: str, required: bool) -> int:
            for source, values in (
                (HF_TOKENIZER_CONFIG, tokenizer_config),
                (HF_SPECIAL_TOKENS_MAP, special_tokens_map),
            ):
                token = _token_text(values.get(f"{name}_token"))
                if token:
                    token_id = self._model.token_to_id(token)
                    if token_id is None:
                        raise ValueError(
                            f"{name}_token {token!r} of {source} is not in its vocabulary"
                        )
                    return token_id
            token_id = model_config.get(f"{name}_token_id")
            if isinstance(token_id, list):
                token_id = token_id[0] if token_id else None
            if isinstance(token_id, int) and not isinstance(token_id, bool):
                if not 0 <= token_id < n_words:
                    raise ValueError(
                        f"{name}_token_id {token_id} of {HF_MODEL_CONFIG} is outside the "
                        f"vocabulary (0..{n_words - 1})"
                    )
                return token_id
            if required:
                raise ValueError(
                    f"defines no {name.upper()} token: set {name}_token in {HF_TOKENIZER_CONFIG} "
                    f"or {name}_token_id in {HF_MODEL_CONFIG} next to it"
                )
            return -1

        self._bos_id = special("bos", required=True)
        self._eos_id = special("eos", required=True)
        self._pad_id = special("pad", required=False)

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids: list[int] = [self._bos_id] if bos else []
        ids.extend(self._model.encode(text, add_special_tokens=False).ids)
        if eos:
            ids.append(self._eos_id)
        return ids

    def encode_rendered(self, text: str) -> tuple[list[int], list[int]]:
        """Ids of a chat template's rendering, its special-token text read as special tokens
        (``transformers``' ``apply_chat_template``), and each token's ``(start, end)``
        characters."""
        self._model.encode_special_tokens = False
        try:
            encoding = self._model.encode(text, add_special_tokens=False)
        finally:
            self._model.encode_special_tokens = True
        return encoding.ids, list(encoding.offsets)

    def template_variables(self) -> dict[str, str]:
        """The special-token texts a chat template is rendered with, ``bos_token``,
        ``eos_token``, ..., as ``transformers`` (5.x) reads them: from ``tokenizer_config.json``,
        and where it has no ``added_tokens_decoder`` (an older save), from
        ``special_tokens_map.json`` over it."""
        out: dict[str, str] = {}
        sources = [self._tokenizer_config]
        if "added_tokens_decoder" not in self._tokenizer_config:
            sources.append(self._special_tokens_map)
        for values in sources:
            for name in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"):
                token = _token_text(values.get(f"{name}_token"))
                if token is not None:
                    out[f"{name}_token"] = token
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a tokenizers.Tokenizer comes back from pickle (a data loader worker, say) without it
        self.__dict__.update(state)
        self._model.encode_special_tokens = True

    def id_to_token(self, token_id: int) -> str | None:
        """The token string of ``token_id`` (None if the vocabulary has no such id)."""
        return self._model.id_to_token(int(token_id))

    def tokenizer_config(self) -> dict[str, Any]:
        """A copy of the ``tokenizer_config.json`` next to the file ({} if there is none)."""
        return json.loads(json.dumps(self._tokenizer_config))

    def decode(self, ids: Sequence[int]) -> str:
        # special tokens are kept and spaces are not "cleaned up": what transformers' decode gives
        # for a BPE tokenizer
        return self._model.decode([int(i) for i in ids], skip_special_tokens=False)


def _token_text(entry: Any) -> str | None:
    """A special-token entry of ``tokenizer_config.json`` / ``special_tokens_map.json``: a
    string, or a dict whose ``content`` is the token; None otherwise."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _config_vocab_size(model_config: dict[str, Any]) -> Any:
    """``vocab_size`` of a ``config.json``; a multimodal one (Llama 4's
    ``Llama4ForConditionalGeneration``) keeps the language model's under ``text_config``."""
    if "vocab_size" in model_config:
        return model_config["vocab_size"]
    text_config = model_config.get("text_config")
    return text_config.get("vocab_size") if isinstance(text_config, dict) else None


def _read_json_object(path: str) -> dict[str, Any]:
    """The JSON object in ``path``; {} if there is no such file. ValueError if it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ValueError(f"cannot read {os.path.basename(path)} ({e.strerror})") from None
    except ValueError as e:
        raise ValueError(f"{os.path.basename(path)} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{os.path.basename(path)} does not hold a JSON object")
    return value


_BPE_LINE_RE = re.compile(rb"[A-Za-z0-9+/]+={0,2} \d+")
_SNIFF_BYTES = 1 << 16
_MAX_TOKENIZER_BYTES = 1 << 29


def _looks_like_tiktoken_bpe(head: bytes, complete: bool) -> bool:
    """Whether ``head`` (the start of a file; all of it if ``complete``) reads as a tiktoken BPE
    file: non-empty lines of ``<base64> <int>``."""
    lines = head.splitlines()
    if not complete:
        lines = lines[:-1]  # the last line may be cut short
    lines = [line.strip() for line in lines if line.strip()]
    if not lines:
        return False
    for line in lines:
        if not _BPE_LINE_RE.fullmatch(line):
            return False
        try:
            base64.b64decode(line.split()[0], validate=True)
        except (binascii.Error, ValueError):
            return False
    return True


# Where a folder keeps its tokenizer, in the order looked for: a Hugging Face tokenizer.json, a
# tokenizer.model at the top (Llama 2's SentencePiece model, or this library's export), then
# original/tokenizer.model (where the Llama 3 repositories keep the tiktoken BPE file).
FOLDER_TOKENIZER_FILES = (
    HF_TOKENIZER_FILE,
    "tokenizer.model",
    os.path.join("original", "tokenizer.model"),
)


def tokenizer_file_in(folder: str | os.PathLike) -> str | None:
    """The tokenizer file a folder provides (see ``FOLDER_TOKENIZER_FILES``), None if none."""
    for name in FOLDER_TOKENIZER_FILES:
        candidate = os.path.join(os.fspath(folder), name)
        if os.path.isfile(candidate):
            return candidate
    return None


def build_tokenizer(path: str | os.PathLike, *, key: str = "model.tokenizer_path") -> Tokenizer:
    """Load the tokenizer at ``path``, detecting its kind from the content.

    ``path`` is a tiktoken BPE file, a SentencePiece model, a Hugging Face ``tokenizer.json``, or
    a folder holding one of them (``tokenizer_file_in``). ``key`` is the setting the path came
    from, named in errors. Raises :class:`ConfigError` (one line) if the path is missing, a folder
    without a tokenizer, unreadable, or of no known kind.
    """
    path = os.fspath(path)
    if not path:
        raise ConfigError(f"{key}: no tokenizer given; {_TOKENIZER_HELP}")
    if os.path.isdir(path):
        found = tokenizer_file_in(path)
        if found is None:
            raise ConfigError(
                f"{key}: {path!r} is a directory with none of "
                f"{', '.join(FOLDER_TOKENIZER_FILES)} in it; {_TOKENIZER_HELP}"
            )
        path = found
    if not os.path.exists(path):
        raise ConfigError(f"{key}: {path!r} does not exist; {_TOKENIZER_HELP}")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"{key}: cannot read {path!r} ({reason}); {_TOKENIZER_HELP}") from None
    if size > _MAX_TOKENIZER_BYTES:
        raise ConfigError(
            f"{key}: {path!r} is {size} bytes, far too large for a tokenizer file (a checkpoint?); "
            f"{_TOKENIZER_HELP}"
        )

    if head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"{"):
        try:
            return HuggingFaceTokenizer(path)
        except Exception as e:  # not a tokenizer.json, or no BOS / EOS next to it
            raise ConfigError(
                f"{key}: {path!r} is JSON but does not load as a Hugging Face tokenizer.json "
                f"({_first_line(e)}); {_TOKENIZER_HELP}"
            ) from None
    if _looks_like_tiktoken_bpe(head, complete=len(head) >= size):
        try:
            return TikTokenizer(path)
        except Exception as e:  # a malformed BPE file (duplicate ranks, say)
            raise ConfigError(
                f"{key}: {path!r} looks like a tiktoken BPE file but does not load "
                f"({type(e).__name__}: {_first_line(e)}); {_TOKENIZER_HELP}"
            ) from None
    try:
        return SentencePieceTokenizer(path)
    except Exception:
        pass
    raise ConfigError(
        f"{key}: {path!r} is neither a tiktoken BPE file nor a SentencePiece model (nor a "
        f"tokenizer.json); {_TOKENIZER_HELP}"
    )


# The tokenizer a config names when it names none (the project's test tokenizer, relative to the
# working directory as every path of a config is).
DEFAULT_TOKENIZER_PATH = "tests/assets/tokenizer/tiktoken.model"


def tokenizer_source(model_cfg: Any) -> tuple[str, str]:
    """``(path, key)``: the tokenizer a ``[model]`` config section selects and the key it came
    from, for ``build_tokenizer(path, key=key)``.

    ``model.tokenizer_path`` when it is set to anything but its default; else
    ``model.hf_assets_path`` when that is set (the folder's tokenizer, see ``tokenizer_file_in``);
    else the default ``tokenizer_path``. An empty or None ``tokenizer_path`` counts as unset.
    A section that states the rule itself (a ``tokenizer_source()`` method, as the config's
    ``Model`` has) is asked, so that there is one rule.
    """
    own_rule = getattr(model_cfg, "tokenizer_source", None)
    if callable(own_rule):
        path, key = own_rule()
        if path:
            return os.fspath(path), key
    tokenizer_path = getattr(model_cfg, "tokenizer_path", None) or ""
    hf_assets_path = getattr(model_cfg, "hf_assets_path", None) or ""
    default = _field_default(model_cfg, "tokenizer_path") or DEFAULT_TOKENIZER_PATH
    if tokenizer_path and tokenizer_path != default:
        return tokenizer_path, "model.tokenizer_path"
    if hf_assets_path:
        return hf_assets_path, "model.hf_assets_path"
    return tokenizer_path or default, "model.tokenizer_path"


def resolve_tokenizer_path(model_cfg: Any) -> str:
    """The tokenizer path a ``[model]`` config section selects (see ``tokenizer_source``)."""
    return tokenizer_source(model_cfg)[0]


def _field_default(obj: Any, name: str) -> Any:
    """The declared default of dataclass field ``name`` of ``obj`` (None if there is none)."""
    import dataclasses

    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name == name and f.default is not dataclasses.MISSING:
                return f.default
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
