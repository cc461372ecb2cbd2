"""One virtual shard of a dataset, packed into fixed-length token windows; its position is
checkpointable.

Packing
    Documents are tokenized with BOS and EOS and appended to the shard's token buffer, which is cut
    into consecutive, non-overlapping windows of ``seq_len + 1`` tokens. Each document (one
    ``encode`` result, one row of token ids or one conversation) starts where its first token
    lands in the buffer; a window comes with marks per position (:data:`~torchtitan.data.batch.
    DOC_START` where a document starts, :data:`~torchtitan.data.batch.NOT_PREDICTED` on a token
    that is not a target).

Conversations
    A row whose field holds a list of messages is a conversation
    (:mod:`torchtitan.data.chat`): its chat template's rendering, with no BOS/EOS added, and only
    its assistant turns predicted. The runs of positions that are not predicted travel with the
    buffer like the document starts.

Bad rows
    A row without the text field, or whose value is not a string (a null counts as missing), stops
    training with :class:`~torchtitan.errors.DataError` naming the dataset, the row's index within
    this virtual shard, the field and the fields the row does have. Skipping such rows would hide a
    wrong ``training.dataset_text_field`` (every row would be skipped and the loader would spin
    forever) or a broken file; pretraining data is expected to be clean, and a clear stop is
    cheaper than a silently different corpus. The loader reads each rank's first row when it is
    built (:meth:`ShardReader.check_first_row`), so that a wrong field stops the run before the
    model is built.

Epochs
    In infinite mode a shard loops over its rows forever (the first shard of each rank logs a line
    at the end of every pass; the order is the same in every pass, nothing is shuffled). A
    non-infinite shard ends its pass when it has no whole window left, dropping the partial window.

State
    :meth:`ShardReader.state` is UTF-8 JSON with the shard's epoch, row position (and, for a
    streamed dataset, ``IterableDataset.state_dict()``), windows served, leftover token buffer and
    the positions in that buffer where documents start (``"starts"``) and the ``[start, stop)``
    runs of its tokens that are not predicted (``"not_predicted"``), so that a fresh reader given
    this state yields exactly the windows (and document starts) the saved one would have yielded
    next (a state without ``"not_predicted"`` predicts every token). A state saved before
    ``"starts"`` existed still loads: its leftover buffer is read as the
    tail of one document, which it always is when saved by this reader (a document is read only
    while the buffer is shorter than a window, so it starts in the window cut next); ``"starts"``
    keeps the state exact for any reading order.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from torchtitan.data.batch import DOC_START, NOT_PREDICTED
from torchtitan.data.chat import ChatEncoder, ChatError, is_conversation
from torchtitan.data.token_windows import ShardPermutations
from torchtitan.errors import ConfigError, DataError
from torchtitan.observability.log import logger

if TYPE_CHECKING:  # ``datasets`` takes ~0.5 s to import: only where data is read (not preflight)
    from datasets import Dataset, IterableDataset

STATE_VERSION = 1
_ROWS_PER_READ = 256  # rows fetched at once from a map-style dataset


class Tokenizer(Protocol):
    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]: ...


class ShardReader:
    """One virtual shard: its rows, its packing buffer and its position; yields token windows.

    Reading is lazy: a row is read (and counted in the position) only when its tokens are needed,
    so the state between two windows is exact.

    ``label`` names the dataset in messages; ``index`` is this shard's number among
    ``virtual_shards``; ``first_on_rank`` marks the shard that logs epoch ends at INFO (the others
    log at DEBUG) and warns about a checkpoint saved for another dataset. ``window`` is
    ``seq_len + 1`` tokens; ``streaming`` says whether ``ds`` is an ``IterableDataset``.
    ``read_error`` turns an error of the ``datasets`` reader part-way through a stream (a
    malformed line of a JSON file) into the DataError to stop with.
    """

    def __init__(
        self,
        ds: Dataset | IterableDataset,
        *,
        index: int,
        virtual_shards: int,
        tokenizer: Tokenizer,
        text_field: str,
        label: str,
        window: int,
        infinite: bool,
        streaming: bool,
        first_on_rank: bool,
        permutations: ShardPermutations | None = None,
        stream_shuffle: tuple[int, int] | None = None,
        shuffle_files: bool = False,
        read_error: Callable[[Exception], DataError] | None = None,
        chat: ChatEncoder | None = None,
    ) -> None:
        self.index = index
        self.virtual_shards = virtual_shards
        self.tokenizer = tokenizer
        self.text_field = text_field
        self.label = label
        self.window = window
        self.infinite = infinite
        self.streaming = streaming
        self.first_on_rank = first_on_rank
        self._read_error = read_error
        self.chat = chat
        self._ds = ds
        # Shuffled map-style data: ``ds`` is the whole dataset, each epoch's rows come from here.
        self._perms = permutations
        # Shuffled streamed data: (buffer size, seed) of a shuffle buffer over the stream.
        self._shuffle = None if stream_shuffle is None else ShuffleBuffer(*stream_shuffle, index)
        # ... and each epoch reads this shard's files in a new order (when it holds whole files)
        self._shuffle_files = shuffle_files and self._shuffle is not None
        self._stream: Any = None  # this epoch's stream of the shard (its files in their order)
        if permutations is not None:
            start, stop = permutations.bounds(index)
            self._len = stop - start
        else:
            self._len = 0 if streaming else len(ds)
        if not streaming:
            # Reading only the text column keeps wide datasets cheap; full rows only for errors.
            self._texts = ds.select_columns([text_field]) if text_field in ds.column_names else None
        # Position: epoch (0-based), rows consumed in this epoch, windows yielded so far, leftover
        # tokens and where documents start among them (ascending buffer positions); for streamed
        # data, a saved IterableDataset state waiting to be applied.
        self.epoch = 0
        self.row = 0
        self.windows = 0
        self.buffer: list[int] = []
        self.starts: list[int] = []
        self.not_predicted: list[list[int]] = []  # ascending [start, stop) runs of the buffer
        self._pending_hf_state: dict | None = None
        self._texts_iter: Iterator[str] | None = None

    def __len__(self) -> int:
        return self._len

    # ---- rows

    def _bad_row(self, index: int, row: dict[str, Any]) -> DataError:
        field = self.text_field
        fields = sorted(k for k, v in row.items() if v is not None)
        value = row.get(field)
        if value is None:
            problem = f"has no field '{field}' (missing or null)"
        else:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            want = "a string, a list of integer token ids or a conversation (a list of messages)"
            problem = f"field '{field}' holds {type(value).__name__} {shown}, not {want}"
        return DataError(
            f"dataset '{self.label}': row {index} of virtual shard {self.index} "
            f"(of {self.virtual_shards}) {problem}; the row has fields {fields}; set "
            f"training.dataset_text_field to the field that holds the text"
        )

    def _map_style_texts(self) -> Iterator[str]:
        ds, n, field = self._ds, self._len, self.text_field
        order = None if self._perms is None else self._perms.rows(self.epoch, self.index)
        i = self.row
        while i < n:
            rows = (
                range(i, min(n, i + _ROWS_PER_READ))
                if order is None
                else order[i : i + _ROWS_PER_READ]
            )
            if self._texts is None:
                raise self._bad_row(i, ds[int(rows[0])])
            if order is None:
                texts = self._texts[i : i + _ROWS_PER_READ][field]
            else:
                texts = self._texts[rows.tolist()][field]
            for j, text in enumerate(texts):
                if not (isinstance(text, str) or is_conversation(text)):
                    raise self._bad_row(i + j, ds[int(rows[j])])
                self.row = i + j + 1
                yield text
            i += len(texts)

    def texts(self) -> Iterator[str]:
        """Every document of a map-style shard, in order, each row checked as in training."""
        self.rewind()
        return self._map_style_texts()

    def _streamed_texts(self) -> Iterator[str]:
        ds = self._stream = self._epoch_stream()
        if ds is self._ds:
            # Each pass has its own epoch number, so a loaded start state applies to its pass
            # only (datasets re-applies it to every pass with the same epoch).
            ds.set_epoch(self.epoch)
        shuffle = self._shuffle
        if self._pending_hf_state is not None:
            ds.load_state_dict(self._pending_hf_state)
        elif shuffle is not None:
            shuffle.reset(self.epoch)
        self._pending_hf_state = None
        field = self.text_field
        for row in self._rows(ds):
            text = row.get(field)
            if not isinstance(text, (str, list)):
                raise self._bad_row(self.row, row)
            out = text if shuffle is None else shuffle.push(text)
            if out is not None:
                self.row += 1
                yield out
        while shuffle is not None and shuffle.docs:  # the stream is done: empty the buffer
            self.row += 1
            yield shuffle.pop()

    def _rows(self, ds: Any) -> Iterator[dict[str, Any]]:
        """The rows of a stream; a file that cannot be read part-way is one DataError line."""
        rows = iter(ds)
        while True:
            try:
                row = next(rows, None)
            except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
                if self._read_error is None:
                    raise
                raise self._read_error(e) from None
            if row is None:
                return
            yield row

    def check_first_row(self) -> None:
        """Read the row training reads first (the position does not move): a text field that
        is missing or not text, or a shard without rows, stops here, before the model is
        built, with the line that reading it would give."""
        if self.streaming:
            row = next(self._rows(self._ds), None)
            if row is None:
                self._end_of_rows()
            elif not isinstance(row.get(self.text_field), (str, list)):
                raise self._bad_row(0, row)
            elif is_conversation(row[self.text_field]):
                self._conversation(row[self.text_field], 0)
            return
        if self._len == 0:
            self._end_of_rows()
        first = 0 if self._perms is None else int(self._perms.rows(0, self.index)[0])
        text = None if self._texts is None else self._texts[first][self.text_field]
        if not (isinstance(text, str) or is_conversation(text)):
            raise self._bad_row(0, self._ds[first])
        if is_conversation(text):
            self._conversation(text, 0)

    def _conversation(self, messages: list[dict[str, Any]], row: int) -> tuple[list[int], list]:
        """A conversation's ids and its runs of positions not predicted; a row that cannot be
        rendered is one DataError line naming it."""
        if self.chat is None:
            raise DataError(
                f"dataset '{self.label}': row {row} of virtual shard {self.index} is a "
                "conversation, but this loader reads no conversations"
            )
        try:
            return self.chat.encode(messages)
        except ChatError as e:
            raise DataError(
                f"dataset '{self.label}': conversation in row {row} of virtual shard "
                f"{self.index} (of {self.virtual_shards}): {e}"
            ) from None

    def _epoch_stream(self) -> Any:
        """The shard's stream for this epoch: with file shuffling, its files (``datasets``
        shards) concatenated in an order seeded by (seed, shard, epoch)."""
        n = getattr(self._ds, "num_shards", 1)
        if not self._shuffle_files or n < 2:
            return self._ds
        from datasets import concatenate_datasets

        assert self._shuffle is not None
        order = np.random.default_rng([self._shuffle.seed, self.index, self.epoch, 1]).permutation(
            n
        )
        return concatenate_datasets([self._ds.shard(num_shards=n, index=int(i)) for i in order])

    def _next_text(self) -> str | list[int] | None:
        """The next document of this pass, or None at the end of the pass."""
        if self._texts_iter is None:
            self._texts_iter = self._streamed_texts() if self.streaming else self._map_style_texts()
        return next(self._texts_iter, None)

    # ---- windows

    def next_window(self) -> tuple[list[int], np.ndarray] | None:
        """The next ``window`` tokens and their marks (uint8 per position: ``DOC_START`` where
        a document starts, ``NOT_PREDICTED`` on a token that is no target); None when a
        non-infinite pass ends (the shard rewinds)."""
        window, buffer = self.window, self.buffer  # replaced only by a pass's end that stops
        while len(buffer) < window:
            text = self._next_text()
            if text is None:
                self._end_of_rows()
                if not self.infinite:
                    return None
                continue
            self._append(text)
        out = buffer[:window]
        del buffer[:window]
        marks = np.zeros(window, dtype=np.uint8)
        k = bisect_left(self.starts, window)  # the starts before the cut
        marks[self.starts[:k]] = DOC_START
        self.starts = [p - window for p in self.starts[k:]]
        rest = []
        for a, b in self.not_predicted:
            marks[a : min(b, window)] |= NOT_PREDICTED
            if b > window:
                rest.append([max(a, window) - window, b - window])
        self.not_predicted = rest
        self.windows += 1
        return out, marks

    def _append(self, text: str | list) -> None:
        """One document into the buffer: a text tokenized with BOS and EOS, a conversation
        (:mod:`~torchtitan.data.chat`), or a row of token ids read as stored (an empty one
        starts nothing)."""
        runs: list = []
        if isinstance(text, str):
            ids = self.tokenizer.encode(text, bos=True, eos=True)
        elif is_conversation(text):
            ids, runs = self._conversation(text, self.row - 1)
        else:
            ids = self._checked_ids(text)
        if ids:
            at = len(self.buffer)
            self.starts.append(at)
            self.buffer.extend(ids)
            self.not_predicted.extend([a + at, b + at] for a, b in runs)

    def _end_of_rows(self) -> None:
        """The pass has no row left: end it (or stop, if the shard has no rows at all)."""
        if self.row == 0:
            raise DataError(
                f"dataset '{self.label}': virtual shard {self.index} (of "
                f"{self.virtual_shards}) has no rows; use a larger dataset or a smaller "
                "training.global_batch_size (one virtual shard per sequence of the global batch)"
            )
        self._end_pass()

    def _checked_ids(self, ids: list[int]) -> list[int]:
        vocab = getattr(self.tokenizer, "n_words", None)
        bad = [i for i in ids if not isinstance(i, int) or i < 0 or (vocab and i >= vocab)]
        if bad:
            raise DataError(
                f"dataset '{self.label}': token id {bad[0]!r} in row {self.row - 1} of virtual shard "
                f"{self.index} is outside the tokenizer's vocabulary [0, {vocab}); the data was "
                "tokenized with another tokenizer, or model.tokenizer_path is wrong"
            )
        return ids

    def _end_pass(self) -> None:
        self.epoch += 1
        self.row = 0
        self._texts_iter = None
        if not self.infinite:
            self.buffer, self.starts, self.not_predicted = [], [], []
            return
        log = logger.info if self.first_on_rank else logger.debug
        log(
            f"dataset {self.label}: virtual shard {self.index} finished epoch "
            f"{self.epoch}, starting epoch {self.epoch + 1}"
            + (" (rows reshuffled)" if self._perms is not None else "")
        )

    def rewind(self) -> None:
        """Start a fresh pass from the beginning of the shard (a non-infinite loader's next iter)."""
        self._texts_iter = None
        self._pending_hf_state = None
        self.row = 0
        self.buffer, self.starts, self.not_predicted = [], [], []
        self.epoch = 0  # every pass of a non-infinite loader is the same (and equally shuffled)
        self.windows = 0

    # ---- state

    def state(self) -> bytes:
        hf_state = None
        if self.streaming and self.row > 0:
            hf_state = self._pending_hf_state or self._stream.state_dict()
        state = {
            "version": STATE_VERSION,
            "dataset": self.label,
            "streaming": self.streaming,
            "epoch": self.epoch,
            "row": self.row,
            "windows": self.windows,
            "buffer": self.buffer,
            "starts": self.starts,
            "not_predicted": self.not_predicted,
            "hf_state": hf_state,
            "order": self._order_name(),
            "shuffle_buffer": None if self._shuffle is None else self._shuffle.state(),
        }
        return json.dumps(state, separators=(",", ":")).encode()

    def _order_name(self) -> str:
        if self._shuffle is not None:
            files = ", files reshuffled every epoch" if self._shuffle_files else ""
            return f"buffer-shuffled ({self._shuffle.size} documents{files}), seed {self._shuffle.seed}"
        return "stored" if self._perms is None else f"shuffled, seed {self._perms.seed}"

    def load(self, blob: bytes) -> None:
        state = json.loads(blob)
        label = self.label
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"data loader checkpoint: state version {state.get('version')}, "
                f"this code reads version {STATE_VERSION}"
            )
        if state["streaming"] != self.streaming:
            mode = {True: "streamed", False: "map-style"}
            raise ConfigError(
                f"data loader checkpoint: saved from a {mode[state['streaming']]} dataset, but "
                f"training.dataset_streaming makes this one {mode[self.streaming]}; use the same "
                "setting to resume"
            )
        if state["dataset"] != label and self.first_on_rank:
            logger.warning(
                f"data loader checkpoint was saved for dataset '{state['dataset']}', "
                f"now reading '{label}'; resuming at the saved position anyway"
            )
        saved_order = state.get("order", "stored")
        if saved_order != self._order_name() and self.first_on_rank:
            logger.warning(
                f"data loader checkpoint of dataset '{label}' read rows in {saved_order} order, "
                f"this run in {self._order_name()} order; resuming at the saved row position"
            )
        if not self.streaming and state["row"] > len(self):
            raise ConfigError(
                f"data loader checkpoint: saved at row {state['row']} of virtual shard "
                f"{self.index}, but dataset '{label}' has {len(self)} rows there; did the "
                "data change?"
            )
        self.epoch = state["epoch"]
        self.row = state["row"]
        self.windows = state["windows"]
        self.buffer = list(state["buffer"])
        self.starts = self._saved_starts(state)
        self.not_predicted = self._saved_runs(state)
        self._texts_iter = None
        self._pending_hf_state = state["hf_state"] if self.streaming and self.row > 0 else None
        if self._shuffle is not None:
            saved = state.get("shuffle_buffer")
            self._shuffle.reset(self.epoch)
            if saved is not None and self._pending_hf_state is not None:
                self._shuffle.load(saved)

    def _saved_starts(self, state: dict[str, Any]) -> list[int]:
        """The saved document starts in the leftover buffer; none in a state saved before they
        were kept (the leftover is then read as the tail of one document)."""
        starts = state.get("starts", [])
        n = len(state["buffer"])
        ok = isinstance(starts, list) and all(isinstance(p, int) for p in starts)
        if not ok or any(not 0 <= p < n for p in starts) or starts != sorted(set(starts)):
            raise ConfigError(
                f"data loader checkpoint: virtual shard {self.index} of dataset '{self.label}' "
                f"has document starts {str(starts)[:60]} that are not ascending positions in its "
                f"leftover buffer of {n} tokens; the checkpoint is damaged"
            )
        return list(starts)

    def _saved_runs(self, state: dict[str, Any]) -> list[list[int]]:
        """The saved runs of tokens not predicted in the leftover buffer (none if not saved)."""
        runs = state.get("not_predicted", [])
        n, last = len(state["buffer"]), 0
        ok = isinstance(runs, list)
        for run in runs if ok else []:
            ok = (
                isinstance(run, list)
                and len(run) == 2
                and all(isinstance(p, int) for p in run)
                and last <= run[0] < run[1] <= n
            )
            if not ok:
                break
            last = run[1]
        if not ok:
            raise ConfigError(
                f"data loader checkpoint: virtual shard {self.index} of dataset '{self.label}' "
                f"has runs of tokens not predicted {str(runs)[:60]} that are not ascending "
                f"[start, stop) ranges in its leftover buffer of {n} tokens; the checkpoint is "
                "damaged"
            )
        return [list(r) for r in runs]


class ShuffleBuffer:
    """A seeded shuffle buffer over a stream of documents, for one virtual shard.

    Until ``size`` documents are held, each new one is kept; then each new one takes the place of a
    held one picked at random, which is read next. When the stream ends the held ones are read in
    random order. The held documents and the generator's state are the buffer's whole state, so a
    resumed run continues the same order exactly (the price: the documents are in the checkpoint).
    Epoch ``e`` of shard ``v`` draws from a generator seeded by ``(seed, v, e)``.
    """

    def __init__(self, size: int, seed: int, shard: int) -> None:
        self.size, self.seed, self.shard = size, seed, shard
        self.docs: list[str] = []
        self.rng = np.random.default_rng([seed, shard, 0])

    def reset(self, epoch: int) -> None:
        self.docs = []
        self.rng = np.random.default_rng([self.seed, self.shard, epoch])

    def push(self, doc: str) -> str | None:
        if self.size == 0:
            return doc
        if len(self.docs) < self.size:
            self.docs.append(doc)
            return None
        i = int(self.rng.integers(self.size))
        out, self.docs[i] = self.docs[i], doc
        return out

    def pop(self) -> str:
        i = int(self.rng.integers(len(self.docs)))
        self.docs[i], self.docs[-1] = self.docs[-1], self.docs[i]
        return self.docs.pop()

    def state(self) -> dict[str, Any]:
        return {"docs": self.docs, "rng": self.rng.bit_generator.state}

    def load(self, state: dict[str, Any]) -> None:
        self.docs = list(state["docs"])
        self.rng.bit_generator.state = state["rng"]
