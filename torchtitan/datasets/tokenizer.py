"""Tokenizers: Llama 3 tiktoken BPE and Llama 2 SentencePiece, chosen from the file's content.

``build_tokenizer(path)`` looks at the file and returns a :class:`TikTokenizer` (a tiktoken BPE file:
UTF-8 lines ``<base64 token bytes> <rank>``, as Llama 3's ``original/tokenizer.model``) or a
:class:`SentencePieceTokenizer` (a SentencePiece model proto, as Llama 2's ``tokenizer.model``).
"""

from __future__ import annotations

import base64
import binascii
import functools
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
    "build_tokenizer",
    "LLAMA3_SPLIT_PATTERN",
    "llama3_special_tokens",
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

# tiktoken gets very slow (quadratic) on huge pieces and its regex on huge whitespace runs, so
# encode() works on chunks of at most this many characters ...
MAX_CHUNK_CHARS = 400_000
# ... each further cut so that no run of consecutive whitespace (or non-whitespace) is longer.
MAX_RUN_CHARS = 25_000

_TOKENIZER_HELP = (
    "give the Llama 3 original/tokenizer.model or a Llama 2 tokenizer.model "
    "(see scripts/download_tokenizer.py)"
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


class Tokenizer(ABC):
    """Text <-> token ids. ``n_words`` is the vocabulary size the model's embedding needs.

    Subclasses set ``_model`` (whose ``decode`` takes a list of ints), ``_n_words``, ``_bos_id``,
    ``_eos_id`` and ``_pad_id`` (-1 when the tokenizer has none), and implement ``encode``.
    """

    _model: Any
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


class TikTokenizer(Tokenizer):
    """Llama 3 tokenizer: a tiktoken BPE file plus the 256 Llama 3 special tokens after it.

    Special-token text inside a document (``"<|end_of_text|>"``) is encoded as ordinary text, so
    data cannot inject control tokens; ``bos``/``eos`` are the only way to get them.
    """

    def __init__(self, path: str | os.PathLike):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.path = os.fspath(path)
        mergeable_ranks = load_tiktoken_bpe(self.path)
        num_base = len(mergeable_ranks)
        ranks = set(mergeable_ranks.values())
        if len(ranks) != num_base or min(ranks, default=0) != 0 or max(ranks) != num_base - 1:
            raise ValueError("ranks are not 0..N-1, each given to exactly one token")
        self._special_tokens = {
            token: num_base + i for i, token in enumerate(llama3_special_tokens())
        }
        self._model = tiktoken.Encoding(
            name=os.path.basename(self.path),
            pat_str=LLAMA3_SPLIT_PATTERN,
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


def build_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load the tokenizer at ``path`` (the ``model.tokenizer_path`` setting), detecting its kind.

    Raises :class:`ConfigError` if the path is missing, a directory, unreadable, or neither kind.
    """
    path = os.fspath(path)
    key = "model.tokenizer_path"
    if not path:
        raise ConfigError(f"{key}: no tokenizer given; {_TOKENIZER_HELP}")
    if os.path.isdir(path):
        raise ConfigError(
            f"{key}: {path!r} is a directory, not a tokenizer file; {_TOKENIZER_HELP}"
        )
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
        f"{key}: {path!r} is neither a tiktoken BPE file nor a SentencePiece model; "
        f"{_TOKENIZER_HELP}"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""
