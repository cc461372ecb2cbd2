"""A tokenized corpus as an endless, random-access stream of ``seq_len + 1`` token windows.

Epoch ``e`` is the corpus's documents concatenated in one order (a seeded permutation of the
documents, new in every epoch, or the stored order when shuffling is off) and cut into
``tokens // window`` consecutive windows; the tokens left over at the end of an epoch (fewer than
one window) are not used in that epoch. Window ``m`` of the stream is window ``m % per_epoch`` of
epoch ``m // per_epoch``.

Because window ``m`` is a function of (corpus, seed, m) alone, a data-parallel rank reads just the
windows it serves, any layout reads the same stream, and the position to save is one number.
Documents are read as stored (a pretokenized corpus holds BOS/EOS already).
:meth:`TokenWindows.window_with_starts` also says where in the window documents start: exactly
where a document's first token falls (a window that begins inside a document has no start at 0).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from torchtitan.errors import DataError
from torchtitan.observability.log import logger


class DocumentStore(Protocol):
    """Tokenized documents: ``doc_lengths[d]`` tokens each, ``read(d, start, stop)`` returns some."""

    label: str
    doc_lengths: np.ndarray

    def read(self, d: int, start: int, stop: int) -> np.ndarray: ...


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The order of ``n`` documents in ``epoch``: a permutation seeded by ``(seed, epoch)``."""
    dtype = np.int32 if n < 2**31 else np.int64
    return np.random.default_rng([seed, epoch]).permutation(n).astype(dtype, copy=False)


class ShardPermutations:
    """Each epoch's permutation of ``n`` rows, cut into ``shards`` contiguous slices (the ranges
    ``datasets`` gives contiguous shards), the last two epochs cached for the readers of a rank."""

    def __init__(self, n: int, seed: int, shards: int) -> None:
        self.n, self.seed, self.shards = n, seed, shards
        self._cache: dict[int, np.ndarray] = {}

    def bounds(self, v: int) -> tuple[int, int]:
        div, mod = divmod(self.n, self.shards)
        start = div * v + min(v, mod)
        return start, start + div + (1 if v < mod else 0)

    def rows(self, epoch: int, v: int) -> np.ndarray:
        """The dataset rows shard ``v`` reads in ``epoch``, in order."""
        perm = self._cache.get(epoch)
        if perm is None:
            perm = epoch_permutation(self.n, self.seed, epoch)
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = perm
        start, stop = self.bounds(v)
        return perm[start:stop]


class HFTokenDocs:
    """The token-id column of a map-style Hugging Face dataset (one list of ids per row)."""

    def __init__(self, ds: Any, *, field: str, label: str) -> None:
        import pyarrow.compute as pc

        self.label = label
        table = ds.flatten_indices().data if getattr(ds, "_indices", None) is not None else ds.data
        self._column = table.column(field)
        self.doc_lengths = pc.list_value_length(self._column).to_numpy(zero_copy_only=False)
        self.doc_lengths = np.nan_to_num(self.doc_lengths).astype(np.int64)  # a null row: empty

    def read(self, d: int, start: int, stop: int) -> np.ndarray:
        values = self._column[d].values
        return np.asarray(values.slice(start, stop - start).to_numpy(zero_copy_only=False))


class InMemoryDocs:
    """Tokenized documents held in memory (a corpus too small to split by rows)."""

    def __init__(self, docs: list[np.ndarray], *, label: str) -> None:
        self.label = label
        self.docs = docs
        self.doc_lengths = np.array([len(d) for d in docs], dtype=np.int64)

    def read(self, d: int, start: int, stop: int) -> np.ndarray:
        return self.docs[d][start:stop]


class TokenWindows:
    """Window ``m`` of ``store``'s documents, concatenated in a per-epoch order.

    ``seed`` and ``shuffle`` fix the order of every epoch; ``vocab_size`` (if given) is checked
    against every window read (a token id at or above it is a :class:`DataError` naming the store);
    ``section`` names the config section in messages; ``log_epochs`` makes this copy log the start
    of each new epoch.
    """

    def __init__(
        self,
        store: DocumentStore,
        *,
        window: int,
        seed: int,
        shuffle: bool,
        vocab_size: int | None = None,
        section: str = "training",
        log_epochs: bool = False,
    ) -> None:
        self.store = store
        self.window = window
        self.seed = seed
        self.shuffle = shuffle
        self.vocab_size = vocab_size
        self.log_epochs = log_epochs
        lengths = np.asarray(store.doc_lengths)  # kept as given (int32 for a large corpus)
        self.num_tokens = int(lengths.sum(dtype=np.int64))
        if len(lengths) == 0:
            raise DataError(f"dataset '{store.label}' is empty: it has no documents")
        if self.num_tokens < window:
            raise DataError(
                f"dataset '{store.label}' has {self.num_tokens:,} tokens, fewer than one window of "
                f"{window:,} ({section}.seq_len + 1); use more data or a shorter {section}.seq_len"
            )
        self._lengths = lengths
        self.per_epoch = self.num_tokens // window
        self._epochs: dict[int, tuple[np.ndarray | None, np.ndarray]] = {}
        self._logged_epoch = -1

    def order(self, epoch: int) -> np.ndarray | None:
        """Epoch ``epoch``'s document order (None: the stored order)."""
        if not self.shuffle:
            return None
        return epoch_permutation(len(self._lengths), self.seed, epoch)

    def _epoch(self, epoch: int) -> tuple[np.ndarray | None, np.ndarray]:
        """``(order, ends)``: the order and the running token count at each document's end."""
        cached = self._epochs.get(epoch)
        if cached is None:
            order = self.order(epoch)
            lengths = self._lengths if order is None else self._lengths[order]
            cached = (order, np.cumsum(lengths, dtype=np.int64))
            if len(self._epochs) >= 2:  # the epoch being read and its successor suffice
                self._epochs.pop(min(self._epochs))
            self._epochs[epoch] = cached
            if self.log_epochs and epoch > self._logged_epoch and epoch > 0:
                how = f"documents reshuffled (seed {self.seed})" if self.shuffle else "same order"
                logger.info(
                    f"dataset {self.store.label}: epoch {epoch + 1} begins at window "
                    f"{epoch * self.per_epoch:,}, {how}"
                )
            self._logged_epoch = max(self._logged_epoch, epoch)
        return cached

    def epoch_of(self, m: int) -> int:
        return m // self.per_epoch

    def __getitem__(self, m: int) -> np.ndarray:
        """Window ``m`` as int64 token ids."""
        return self.window_with_starts(m)[0]

    def window_with_starts(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """Window ``m`` as int64 token ids, and a bool per position: true where a document's
        first token falls."""
        epoch, j = divmod(m, self.per_epoch)
        order, ends = self._epoch(epoch)
        lo, hi = j * self.window, (j + 1) * self.window
        i = int(np.searchsorted(ends, lo, side="right"))
        pieces, pos = [], lo
        starts = np.zeros(self.window, dtype=bool)
        while pos < hi:
            d = i if order is None else int(order[i])
            end = int(ends[i])
            doc_start = end - int(self._lengths[d])
            stop = min(hi, end)
            if pos == doc_start and stop > pos:  # the document's first token (an empty one: none)
                starts[pos - lo] = True
            pieces.append(self.store.read(d, pos - doc_start, stop - doc_start))
            pos, i = stop, i + 1
        out = np.concatenate(pieces).astype(np.int64)
        if self.vocab_size is not None and (out.max() >= self.vocab_size or out.min() < 0):
            bad = int(out.max()) if out.max() >= self.vocab_size else int(out.min())
            raise DataError(
                f"dataset '{self.store.label}': token id {bad} in window {m} is outside the "
                f"tokenizer's vocabulary [0, {self.vocab_size}); the corpus was written with "
                "another tokenizer (see its manifest.json), or model.tokenizer_path is wrong"
            )
        return out, starts
