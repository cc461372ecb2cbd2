"""Pretokenized corpora in Megatron-LM's indexed dataset format (``.bin`` + ``.idx``), memory-mapped.

The format (Megatron-LM ``megatron/core/datasets/indexed_dataset.py``, also read by NeMo):

``PREFIX.bin``
    the token ids of every sequence, back to back, in one little-endian dtype.
``PREFIX.idx``
    ``b"MMIDIDX\\x00\\x00"`` (9 bytes), version ``1`` (u64), the token dtype's code (u8: 1 uint8,
    2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence count ``S``
    (u64), the document-index count ``D + 1`` (u64), then ``S`` sequence lengths (int32), ``S``
    byte offsets of the sequences in ``.bin`` (int64), and ``D + 1`` document indices (int64):
    document ``d`` is sequences ``[doc[d], doc[d + 1])``; ``doc[0] = 0`` and ``doc[D] = S``.
    A multimodal index appends ``S`` int8 modes, which this reader ignores.

A document here is the concatenation of its sequences (Megatron's preprocessing writes one sequence
per document unless it splits sentences). Documents are read as stored: a corpus written by
``scripts/tokenize_dataset.py`` holds BOS + tokens + EOS per document, as the on-the-fly loader
packs them; one written by Megatron's ``preprocess_data.py --append-eod`` holds tokens + EOD.

A corpus is one prefix or a folder of them (``*.idx``, read in name order, hidden files skipped),
optionally with ``manifest.json`` (:data:`MANIFEST`) describing the tokenizer it was written with.
Every check that needs no token data runs when the corpus opens, each failure one line naming the
file: a bad header or version, an index whose sizes do not add up, a ``.bin`` shorter or longer
than its index says (a truncated copy, or an index of another corpus).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.errors import DataError
from torchtitan.observability.log import logger

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron-indexed"
_HEAD = struct.Struct("<9sQBQQ")  # header, version, dtype code, sequences, document indices

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dt: code for code, dt in DTYPE_CODES.items()}
TOKEN_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.int32), np.dtype(np.int64))


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype a corpus of this vocabulary is written in: uint16 when every id fits, else int32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


# ---- writing


def write_index(
    idx_path: str | os.PathLike, dtype: np.dtype, lengths: Sequence[int] | np.ndarray
) -> None:
    """Write ``.idx`` for one sequence per document, the sequences being ``lengths`` tokens long."""
    dtype = np.dtype(dtype)
    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and (sizes.min() < 0 or sizes.max() > np.iinfo(np.int32).max):
        raise ValueError("sequence lengths must be in [0, 2**31)")
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1] * dtype.itemsize, out=pointers[1:])
    docs = np.arange(len(sizes) + 1, dtype=np.int64)
    with open(idx_path, "wb") as f:
        f.write(_HEAD.pack(INDEX_HEADER, INDEX_VERSION, _CODE_OF[dtype], len(sizes), len(docs)))
        f.write(sizes.astype("<i4").tobytes())
        f.write(pointers.astype("<i8").tobytes())
        f.write(docs.astype("<i8").tobytes())


class IndexedWriter:
    """Write one ``PREFIX.bin`` / ``PREFIX.idx`` pair, a document at a time.

    ``add(tokens)`` appends one document; ``close()`` writes the index. Both files are written
    under temporary names and renamed into place by ``close()``, index last, so a reader never
    sees a ``.bin`` without the index that describes it (completeness across files is the caller's
    marker's job).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron code")
        self._bin = open(self.prefix + ".bin.tmp", "wb")
        self.lengths: list[int] = []
        self.tokens = 0

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append one document."""
        arr = np.asarray(tokens)
        self.add_many(arr, [arr.size])

    def add_many(self, tokens: np.ndarray, lengths: Sequence[int] | np.ndarray) -> None:
        """Append several documents at once: ``tokens`` back to back, ``lengths`` each."""
        arr = np.asarray(tokens)
        sizes = [int(n) for n in lengths]
        if sum(sizes) != arr.size:
            raise ValueError(f"lengths add up to {sum(sizes)}, but {arr.size} tokens were given")
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token ids {arr.min()}..{arr.max()} do not fit {self.dtype}")
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self.lengths.extend(sizes)
        self.tokens += int(arr.size)

    def close(self) -> None:
        self._bin.close()
        write_index(self.prefix + ".idx.tmp", self.dtype, self.lengths)
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def abort(self) -> None:
        self._bin.close()
        for ext in (".bin.tmp", ".idx.tmp"):
            Path(self.prefix + ext).unlink(missing_ok=True)


# ---- reading


class IndexedFile:
    """One ``PREFIX.bin`` / ``PREFIX.idx`` pair, memory-mapped and checked on opening.

    ``tokens`` is the whole ``.bin`` as a read-only array; ``doc_start(d)`` is document ``d``'s
    first token's position in it and ``doc_lengths`` every document's token count.
    """

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        idx, bin_ = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx, bin_):
            if not os.path.isfile(path):
                raise DataError(f"indexed corpus '{self.prefix}': {path} does not exist")
        with open(idx, "rb") as f:
            head = f.read(_HEAD.size)
        if len(head) < _HEAD.size or head[:9] != INDEX_HEADER:
            raise DataError(
                f"{idx}: not a Megatron indexed-dataset index (no MMIDIDX header); expected the "
                ".idx written by Megatron-LM/NeMo preprocessing or scripts/tokenize_dataset.py"
            )
        _, version, code, n_seq, n_doc_idx = _HEAD.unpack(head)
        if version != INDEX_VERSION:
            raise DataError(f"{idx}: index version {version}, this reader reads version 1")
        if code not in DTYPE_CODES or DTYPE_CODES[code] not in TOKEN_DTYPES:
            raise DataError(f"{idx}: dtype code {code} is not an integer token dtype")
        self.dtype = DTYPE_CODES[code]
        self._check_index_size(idx, n_seq, n_doc_idx)
        raw = np.memmap(idx, dtype=np.uint8, mode="r")
        off = _HEAD.size
        seq_lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=off)
        pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=off + 4 * n_seq)
        doc_idx = np.frombuffer(raw, dtype="<i8", count=n_doc_idx, offset=off + 12 * n_seq)
        self._check_layout(idx, seq_lengths, pointers, doc_idx)
        size = os.path.getsize(bin_)
        expected = int(seq_lengths.sum(dtype=np.int64)) * self.dtype.itemsize
        if size != expected:
            short = "truncated" if size < expected else "longer than its index says"
            raise DataError(
                f"{bin_}: {size:,} bytes, but {idx} describes {expected:,} "
                f"({expected // self.dtype.itemsize:,} {self.dtype} tokens): the .bin is {short}, "
                "or the .idx belongs to another corpus; copy or write the pair again"
            )
        # Memory-mapped views only: a document's start is read from the index when needed.
        self._pointers, self._doc_idx = pointers, doc_idx
        self.num_tokens = expected // self.dtype.itemsize
        self.tokens = (
            np.memmap(bin_, dtype=self.dtype.newbyteorder("<"), mode="r")
            if expected
            else np.zeros(0, self.dtype)
        )

    @staticmethod
    def _check_index_size(idx: str, n_seq: int, n_doc_idx: int) -> None:
        size = os.path.getsize(idx)
        need = _HEAD.size + 12 * n_seq + 8 * n_doc_idx
        if size not in (need, need + n_seq):  # the multimodal index adds one int8 per sequence
            raise DataError(
                f"{idx}: {size:,} bytes, but its header ({n_seq:,} sequences, {n_doc_idx:,} "
                f"document indices) needs {need:,}: the index is truncated or damaged"
            )

    def _check_layout(
        self, idx: str, lengths: np.ndarray, pointers: np.ndarray, doc_idx: np.ndarray
    ) -> None:
        """Sequences back to back from byte 0, document indices from 0 to the sequence count."""
        n = len(lengths)
        contiguous = np.zeros(n, dtype=np.int64)
        if n > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=contiguous[1:])
        if (lengths < 0).any() or not np.array_equal(pointers, contiguous):
            raise DataError(
                f"{idx}: sequence offsets do not follow the sequence lengths back to back; the "
                "index is damaged"
            )
        if len(doc_idx) == 0 or doc_idx[0] != 0 or doc_idx[-1] != n or (np.diff(doc_idx) < 0).any():
            raise DataError(
                f"{idx}: document indices must rise from 0 to the sequence count {n}; the index "
                "is damaged"
            )

    def __len__(self) -> int:
        return len(self._doc_idx) - 1

    def doc_start(self, d: int) -> int:
        """Document ``d``'s first token's position in ``tokens`` (``d == len(self)``: the end)."""
        seq = int(self._doc_idx[d])
        if seq == len(self._pointers):
            return self.num_tokens
        return int(self._pointers[seq]) // self.dtype.itemsize

    @property
    def doc_lengths(self) -> np.ndarray:
        """Each document's token count (computed from the index: one array, 8 bytes each)."""
        starts = np.append(self._pointers // self.dtype.itemsize, self.num_tokens)
        return np.diff(starts[self._doc_idx])

    def document(self, d: int) -> np.ndarray:
        return self.tokens[self.doc_start(d) : self.doc_start(d + 1)]


@dataclass(frozen=True)
class Manifest:
    """What ``manifest.json`` says of a corpus (all optional for a corpus written elsewhere)."""

    tokenizer: dict[str, Any]
    dtype: str
    documents: int
    tokens: int
    source: dict[str, Any]
    files: list[str]
    bos: bool = True
    eos: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"format": MANIFEST_FORMAT, "version": 1, **self.__dict__}


def read_manifest(folder: str | os.PathLike) -> Manifest | None:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        fields = {k: raw[k] for k in Manifest.__dataclass_fields__ if k in raw}
        return Manifest(**fields)
    except (ValueError, TypeError, KeyError) as e:
        raise DataError(f"{path}: not a readable corpus manifest ({e})") from None


def write_manifest(folder: str | os.PathLike, manifest: Manifest) -> None:
    path = Path(folder) / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=2) + "\n")
    os.replace(tmp, path)


def indexed_prefixes(path: str | os.PathLike) -> list[str] | None:
    """The ``.bin``/``.idx`` prefixes ``path`` names, or None if it is not an indexed corpus.

    ``path`` may be a prefix (``data/corpus`` for ``data/corpus.bin`` + ``.idx``), either file of
    the pair, or a folder whose ``*.idx`` files (hidden ones skipped) are the corpus, in name
    order; a folder with a :data:`MANIFEST` lists its files there.
    """
    p = Path(path).expanduser()
    if p.suffix in (".bin", ".idx") and p.is_file():
        return [str(p.with_suffix(""))]
    if p.is_dir():
        manifest = read_manifest(p)
        if manifest is not None:
            return [str(p / f) for f in manifest.files]
        found = sorted(q for q in p.glob("*.idx") if not q.name.startswith("."))
        return [str(q.with_suffix("")) for q in found] or None
    if Path(str(p) + ".idx").is_file() or Path(str(p) + ".bin").is_file():
        return [str(p)]
    return None


class IndexedCorpus:
    """Several indexed files read as one corpus: documents numbered across files in order."""

    def __init__(self, prefixes: Sequence[str], *, label: str) -> None:
        self.label = label
        self.files = [IndexedFile(p) for p in prefixes]
        dtypes = {str(f.dtype) for f in self.files}
        if len(dtypes) > 1:
            raise DataError(
                f"indexed corpus '{label}': its files mix token dtypes {sorted(dtypes)}"
            )
        counts = np.array([len(f) for f in self.files], dtype=np.int64)
        self._file_start = np.concatenate([[0], np.cumsum(counts)])
        # 4 bytes a document while every document is shorter than 2**31 tokens
        lengths = [f.doc_lengths for f in self.files]
        longest = max((int(x.max()) for x in lengths if x.size), default=0)
        dtype = np.int32 if longest < 2**31 else np.int64
        self.doc_lengths = np.concatenate(
            [x.astype(dtype) for x in lengths] or [np.zeros(0, dtype)]
        )

    @property
    def num_tokens(self) -> int:
        return int(self.doc_lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self.doc_lengths)

    def locate(self, d: int) -> tuple[IndexedFile, int]:
        """The file holding document ``d`` and the document's number within it."""
        f = int(np.searchsorted(self._file_start, d, side="right")) - 1
        return self.files[f], d - int(self._file_start[f])

    def read(self, d: int, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` of document ``d``."""
        file, local = self.locate(d)
        begin = file.doc_start(local)
        return file.tokens[begin + start : begin + stop]


def open_corpus(
    path: str | os.PathLike, *, tokenizer: dict[str, Any] | None, section: str = "training"
) -> IndexedCorpus:
    """The indexed corpus at ``path`` (see :func:`indexed_prefixes`), checked against the job's
    tokenizer (its ``fingerprint()``) when the corpus has a manifest."""
    prefixes = indexed_prefixes(path)
    if not prefixes:
        raise DataError(f"{section}.dataset_path: '{path}' holds no .bin/.idx corpus")
    folder = Path(path) if Path(path).is_dir() else Path(prefixes[0]).parent
    manifest = read_manifest(folder)
    if manifest is None:
        logger.info(
            f"{section}.dataset_path: corpus '{path}' has no {MANIFEST} (written elsewhere, e.g. "
            "by Megatron-LM): its tokenizer cannot be checked; token ids are checked against the "
            "vocabulary as they are read"
        )
    if manifest is not None and tokenizer is not None:
        wrote, job = manifest.tokenizer, tokenizer
        short = lambda k, v: str(v)[:12] if k == "sha256" else v  # noqa: E731
        differs = [
            f"{k} {short(k, wrote.get(k))} vs {short(k, job.get(k))}"
            for k in ("sha256", "vocab_size", "bos_id", "eos_id")
            if k in wrote and wrote.get(k) != job.get(k)
        ]
        if differs:
            raise DataError(
                f"{section}.dataset_path: corpus '{path}' was tokenized with {wrote.get('file')} "
                f"({'; '.join(differs)}), not with this job's tokenizer {job.get('file')}; "
                "tokenize it again with scripts/tokenize_dataset.py or set model.tokenizer_path "
                "to the corpus's tokenizer"
            )
    return IndexedCorpus(prefixes, label=str(path))
