"""The pretraining data loader: one source or a weighted mixture, served as packed token batches.

The global stream
    Step ``t``'s global batch is windows ``[tV, (t+1)V)`` of one global stream of ``seq_len + 1``
    token windows, ``V`` being the global batch size in sequences whatever the data-parallel
    degree; window ``w`` gives ``input = w[:-1]``, ``label = w[1:]``. A
    :class:`~torchtitan.data.blend.Blend` says which source each window comes from (always
    the one source when there is no mixture). Data-parallel rank ``r`` of ``D`` serves rows
    ``[r V/D, (r+1) V/D)`` of every step, ``local_batch_size`` at a time (one batch per
    gradient-accumulation microbatch).

What is yielded
    A :class:`~torchtitan.data.batch.Batch` ``(inputs, labels, doc_ids)``, each
    ``[local_batch_size, seq_len]``: ``inputs`` and ``labels`` int64, ``doc_ids`` int32 numbering
    the documents of each row from 0 (a new number at every input position where a document
    starts: where an ``encode`` result, a row of token ids or a corpus document begins), for
    block-causal attention. With ``mask_document_starts`` the label of a position whose next token
    starts a document is ``IGNORE_INDEX`` (-100): the first token of a document is not predicted
    from the end of the one before it. Which positions start documents is part of the loader's
    position, so a resumed loader yields the same ``doc_ids``.

Sources
    A pretokenized corpus (or a text corpus with fewer rows than ``V``, tokenized whole) is a
    :class:`~torchtitan.data.token_windows.TokenWindows` stream: the ``m``-th window the blend
    gives it is its window ``m``, read directly. Any other dataset is tokenized on the fly: it is
    cut into ``V`` virtual shards with ``datasets.distributed.split_dataset_by_node`` (contiguous
    row ranges for map-style data; whole files, or every ``V``-th row, for streamed data), and row
    ``v`` of the batch reads shard ``v`` (:class:`~torchtitan.data.reader.ShardReader`), one
    window each time the blend gives row ``v`` to that source. Either way the data of step ``t`` is
    a function of (sources, weights, seed, ``t``) only: 1, 2 or 4 ranks read the same sequences.

Epochs
    In infinite mode iteration never ends. A non-infinite loader ends its pass when a row has no
    window left (a shard out of whole windows, or a token stream at the end of its first epoch) and
    rewinds.

Checkpointing
    :meth:`HFDataLoader.state_dict` returns ``{"virtual_shards": V, "shard_<v>": <bytes>}`` for
    this rank's rows that read text sources (each shard's :meth:`~ShardReader.state`; with several
    text sources, a JSON object of them by source name), plus ``"blend": <bytes>`` (the blend's
    position, the same on every rank) when the blend matters: several sources, or a token stream.
    A fresh loader given this state yields exactly the batches the saved one would have yielded
    next. Rows are keyed by index, not by rank, so a run with another data-parallel degree (same
    global batch size) can resume from the union of the saved ranks' states. Each value is one
    opaque object so that a distributed checkpoint loads it back whole.
"""

from __future__ import annotations

import functools
import json
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchtitan.config.checks import global_batch
from torchtitan.data.batch import Batch, make_batch
from torchtitan.data.blend import Blend
from torchtitan.data.chat import ChatEncoder
from torchtitan.data.mixture import (
    SourceSpec,
    describe,
    mixture_specs,
    open_source,
    parse_entries,
)
from torchtitan.data.reader import ShardReader, Tokenizer
from torchtitan.data.sources import Source, read_error
from torchtitan.data.token_windows import ShardPermutations, TokenWindows
from torchtitan.errors import ConfigError, DataError
from torchtitan.observability.log import logger


class HFDataLoader:
    """Packed :class:`Batch` ``(inputs, labels, doc_ids)`` batches for one data-parallel rank;
    checkpointable.

    ``sources`` are opened sources (text :class:`Source` or :class:`TokenWindows`), ``names`` their
    names in metrics and checkpoints, ``weights`` their shares (None: one source);
    ``mask_document_starts`` ignores the labels that are a document's first token. Iterating
    continues from the current position (a fresh loader starts at the beginning, a loader given a
    ``load_state_dict`` starts where the saved one stopped). In infinite mode iteration never ends;
    otherwise one ``iter()`` is one pass, after which the loader rewinds, so the next ``iter()`` is
    a fresh pass.
    """

    def __init__(
        self,
        sources: Sequence[Source | TokenWindows],
        *,
        tokenizer: Tokenizer,
        local_batch_size: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        global_batch_size: int | None = None,
        infinite: bool = True,
        names: Sequence[str] | None = None,
        weights: Sequence[float] | None = None,
        section: str = "training",
        seed: int = 0,
        shuffle: bool = False,
        shuffle_buffer: int = 0,
        mask_document_starts: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.sources = list(sources)
        self.names = list(names) if names else [_label(s) for s in self.sources]
        self.label = ", ".join(_label(s) for s in self.sources)
        self.text_field = next((s.text_field for s in self.sources if isinstance(s, Source)), None)
        self.tokenizer = tokenizer
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.section = section
        self.seed, self.shuffle, self.shuffle_buffer = seed, shuffle, shuffle_buffer
        self.mask_document_starts = mask_document_starts
        self.chat = ChatEncoder(tokenizer, chat_template, key="training.chat_template")
        self.virtual_shards, _ = global_batch(
            local_batch_size, global_batch_size or -1, dp_world_size
        )
        per_rank = self.virtual_shards // dp_world_size
        self.shards = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        self.blend = Blend(weights or [1.0] * len(self.sources), self.names)
        self._saves_blend = len(self.sources) > 1 or any(
            isinstance(s, TokenWindows) for s in self.sources
        )
        self.streaming = False
        # this rank's rows x sources: a shard reader for a text source, None for a token stream
        self._readers: list[list[ShardReader | None]] = [[] for _ in self.shards]
        for src in self.sources:
            readers = self._shard_readers(src) if isinstance(src, Source) else None
            for j in range(len(self.shards)):
                self._readers[j].append(readers[j] if readers else None)
        self._plan: tuple[list[int], list[int]] = ([], [])  # this step's (source, index) per row
        self._step_start = self.blend.state()  # the blend before this step's plan was taken
        self._next_group = 0  # which local_batch_size block of this rank's rows reads next

    def _shard_readers(self, source: Source) -> list[ShardReader]:
        """One reader per row of this rank: shard ``v`` of the text source's ``V`` shards. The
        first row they read is checked now, so that a wrong text field or an empty source stops
        the run before the model is built."""
        ds = source.dataset
        from datasets import IterableDataset
        from datasets.distributed import split_dataset_by_node

        streaming = isinstance(ds, IterableDataset)
        self.streaming = self.streaming or streaming
        if not streaming and len(ds) < self.virtual_shards:
            raise DataError(
                f"dataset '{source.label}' has {len(ds)} rows, fewer than its "
                f"{self.virtual_shards} virtual shards (one per sequence of the global batch); use "
                f"a larger dataset or a smaller {self.section}.global_batch_size"
            )
        # Streamed data split by whole files (datasets' shards) can read them in a new order each
        # epoch; split by rows (every V-th row of every file) it cannot without moving rows.
        whole_files = streaming and (
            self.virtual_shards == 1 or ds.num_shards % self.virtual_shards == 0
        )
        perms = None
        if self.shuffle and not streaming:  # each epoch's permutation of all rows, sliced by shard
            perms = ShardPermutations(len(ds), self.seed, self.virtual_shards)
        readers = [
            ShardReader(
                ds
                if perms is not None or self.virtual_shards == 1
                else split_dataset_by_node(ds, rank=v, world_size=self.virtual_shards),
                permutations=perms,
                stream_shuffle=(self.shuffle_buffer, self.seed)
                if streaming and self.shuffle
                else None,
                shuffle_files=whole_files,
                index=v,
                virtual_shards=self.virtual_shards,
                tokenizer=self.tokenizer,
                text_field=source.text_field,
                label=source.label,
                window=self.seq_len + 1,
                infinite=self.infinite,
                streaming=streaming,
                first_on_rank=v == self.shards[0],
                read_error=functools.partial(read_error, source),
                chat=self.chat,
            )
            for v in self.shards
        ]
        readers[0].check_first_row()
        return readers

    def restart(self) -> None:
        """Read from the beginning again (a validation pass that stopped part-way)."""
        for row in self._readers:
            for r in row:
                if r is not None:
                    r.rewind()
        self.blend = Blend(self.blend.weights, self.names)
        self._step_start = self.blend.state()
        self._next_group = 0

    @property
    def num_rows(self) -> int | None:
        """Rows of text on this rank's shards (None when streamed or pretokenized)."""
        counts = [self.rows_of(i) for i in range(len(self.sources))]
        return None if None in counts else sum(c for c in counts if c is not None)

    def rows_of(self, i: int) -> int | None:
        """Rows of source ``i`` on this rank's shards (None when streamed or pretokenized)."""
        readers = [row[i] for row in self._readers]
        if readers[0] is None or readers[0].streaming:
            return None
        return sum(len(r) for r in readers if r is not None)

    def tokens_per_source(self) -> dict[str, int]:
        """Input tokens each source has given the global stream so far (the same on every rank)."""
        return {n: c * self.seq_len for n, c in zip(self.names, self.blend.counts, strict=True)}

    def _window(self, j: int) -> tuple[list[int] | np.ndarray, np.ndarray] | None:
        """The next window of this rank's row ``j``, from the source this step's plan gives it,
        and where documents start in it."""
        v = self.shards[j]
        i, m = self._plan[0][v], self._plan[1][v]
        src = self.sources[i]
        if isinstance(src, TokenWindows):
            return None if not self.infinite and m >= src.per_epoch else src.window_with_starts(m)
        reader = self._readers[j][i]
        assert reader is not None
        return reader.next_window()

    def __iter__(self) -> Iterator[Batch]:
        while (rows := self.next_rows()) is not None:
            chunk, starts = stack_rows(rows, self.seq_len + 1)
            yield make_batch(chunk, starts, self.mask_document_starts)

    def next_rows(self, positions: Sequence[int] | None = None) -> list[Any] | None:
        """The next local batch's windows, ``(tokens, document starts)`` per row; with
        ``positions``, only those rows of it (a data-loader worker's share: the other rows'
        readers stay where they are). None when the pass is over (the loader then rewinds)."""
        n = self.local_batch_size
        if self._next_group == 0:
            self._step_start = self.blend.state()
            self._plan = self.blend.take(self.virtual_shards)
        g = self._next_group
        rows = [self._window(g * n + i) for i in (range(n) if positions is None else positions)]
        if any(w is None for w in rows):
            self.restart()
            return None
        self._next_group = (g + 1) % (len(self.shards) // n)
        return rows

    # ---- checkpointing

    def state_dict(self, positions: Sequence[int] | None = None) -> dict[str, Any]:
        """``{"virtual_shards": V, "shard_<v>": bytes, ...}`` (see the module docstring); with
        ``positions``, only the shards of those rows of every local batch (a worker's share)."""
        state: dict[str, Any] = {"virtual_shards": self.virtual_shards}
        if self._saves_blend:
            blend = json.loads(self.blend.state() if self._next_group == 0 else self._step_start)
            blend["next_group"] = self._next_group
            blend["layout"] = [self.local_batch_size, self.dp_world_size]
            state["blend"] = json.dumps(blend, separators=(",", ":")).encode()
        text = [i for i, s in enumerate(self.sources) if isinstance(s, Source)]
        for j, v in enumerate(self.shards):
            if positions is not None and j % self.local_batch_size not in positions:
                continue
            if len(text) == 1 and len(self.sources) == 1:
                state[f"shard_{v}"] = self._readers[j][0].state()  # type: ignore[union-attr]
            elif text:
                by_name = {self.names[i]: self._readers[j][i].state().decode() for i in text}  # type: ignore[union-attr]
                state[f"shard_{v}"] = json.dumps(by_name, separators=(",", ":")).encode()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved state; call before iterating (or take a new ``iter()``).

        The state may come from a run with another data-parallel degree: rows are keyed by their
        index, so only the number of virtual shards (the global batch size) must match.
        """
        if not state_dict:
            logger.warning(
                f"dataset {self.label}: empty data loader state on dp rank {self.dp_rank}; "
                "starting from the beginning"
            )
            return
        saved = state_dict.get("virtual_shards")
        if saved != self.virtual_shards:
            raise ConfigError(
                f"data loader checkpoint: saved with {saved} virtual shards (the global batch "
                f"size then), but this run has {self.virtual_shards}; resume with "
                f"{self.section}.global_batch_size = {saved}, or start the data from scratch"
            )
        self._load_blend(state_dict)
        text = [i for i, s in enumerate(self.sources) if isinstance(s, Source)]
        if not text:
            return
        missing = [v for v in self.shards if f"shard_{v}" not in state_dict]
        if missing:
            found = sorted(k for k in state_dict if k.startswith("shard_"))
            raise ConfigError(
                f"data loader checkpoint: no state for virtual shard(s) {missing} of dp rank "
                f"{self.dp_rank} (found: {', '.join(found) or 'none'})"
            )
        for j, v in enumerate(self.shards):
            blob = state_dict[f"shard_{v}"]
            if len(self.sources) == 1:
                self._readers[j][0].load(blob)  # type: ignore[union-attr]
                continue
            by_name = json.loads(blob)
            for i in text:
                if self.names[i] not in by_name:
                    raise ConfigError(
                        f"data loader checkpoint: no state for source '{self.names[i]}' on "
                        f"virtual shard {v} (found: {', '.join(by_name)})"
                    )
                self._readers[j][i].load(by_name[self.names[i]].encode())  # type: ignore[union-attr]
        if not self._saves_blend:
            # One text source: groups advance in order within a step, so the next group is the
            # first one behind group 0.
            n = self.local_batch_size
            counts = [self._readers[g * n][0].windows for g in range(len(self.shards) // n)]  # type: ignore[union-attr]
            self._next_group = next((g for g, c in enumerate(counts) if c < counts[0]), 0)
            if self._next_group:  # inside a step: its plan (one source: every row reads it)
                self._plan = self.blend.take(self.virtual_shards)

    def _load_blend(self, state_dict: dict[str, Any]) -> None:
        if not self._saves_blend:
            return
        if "blend" not in state_dict:
            raise ConfigError(
                f"data loader checkpoint: saved from one text dataset, but this run reads "
                f"{self.label} as a mixture or as pretokenized windows; resume with the same "
                f"{self.section} data settings, or leave the data position behind with "
                "checkpoint.exclude_from_loading = ['dataloader']"
            )
        blob = state_dict["blend"]
        saved = json.loads(blob)
        next_group = int(saved.get("next_group", 0))
        layout = [self.local_batch_size, self.dp_world_size]
        if next_group and (saved.get("layout") != layout or saved["weights"] != self.blend.weights):
            raise ConfigError(
                f"data loader checkpoint: saved after {next_group} microbatch(es) of a step by a "
                f"run with local batch x data-parallel degree {saved.get('layout')} and weights "
                f"{saved['weights']}; a resume inside a step needs the same layout and weights "
                f"({layout}, {self.blend.weights}); resume from a checkpoint at a step's end"
            )
        self.blend.load(blob, section=self.section, warn=self.dp_rank == 0)
        self._next_group = next_group
        self._step_start = self.blend.state()
        if self._next_group:  # saved inside a step: take its plan again
            self._plan = self.blend.take(self.virtual_shards)


def stack_rows(rows: list[Any], window: int) -> tuple[torch.Tensor, np.ndarray]:
    """``(tokens [n, window] int64, document starts [n, window])`` of ``next_rows``' windows."""
    tokens = [w[0] for w in rows]
    if all(isinstance(t, np.ndarray) for t in tokens):
        chunk = torch.from_numpy(np.stack(tokens))
    else:
        flat_rows = [int(t) for w in tokens for t in w]
        # array -> tensor is several times faster than torch.tensor(list)
        chunk = torch.frombuffer(array("q", flat_rows), dtype=torch.long).view(len(rows), window)
    return chunk, np.stack([w[1] for w in rows])


def _label(source: Source | TokenWindows) -> str:
    return source.store.label if isinstance(source, TokenWindows) else source.label


@dataclass(frozen=True)
class DataSpec:
    """What a loader reads, and in what order: one config section's data keys.

    ``datasets`` (``{section}.datasets``: a list of tables, JSON, or ``a:0.7,b:0.3``) makes a
    weighted mixture and replaces ``dataset`` / ``dataset_path`` / ``text_field`` / ``streaming``,
    which otherwise name the one source (``None`` takes the named dataset's defaults: ``"text"``;
    local files are not streamed, Hub datasets are). With ``shuffle``, each epoch reads map-style
    and pretokenized sources in a permutation seeded by (``seed``, epoch), and streamed sources
    through a shuffle buffer of ``shuffle_buffer`` documents per virtual shard.
    ``mask_document_starts`` sets the label of each document's first token to ``IGNORE_INDEX``
    (see the module docstring). ``chat_template`` (``training.chat_template``) renders
    conversations; None: the tokenizer's own template (:mod:`~torchtitan.data.chat`).

    ``section`` is the config section the settings came from (``"training"``, or
    ``"validation"`` for the validation loader): messages name keys of that section.
    """

    dataset: str
    dataset_path: str | None = None
    datasets: Any = None
    text_field: str | None = None
    streaming: bool | None = None
    split: str = "train"
    section: str = "training"
    seed: int = 0
    shuffle: bool = False
    shuffle_buffer: int = 100
    mask_document_starts: bool = False
    chat_template: str | None = None


def build_hf_dataloader(
    data: DataSpec,
    tokenizer: Tokenizer,
    *,
    local_batch_size: int,
    seq_len: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    global_batch_size: int | None = None,
    infinite: bool = True,
) -> HFDataLoader:
    """The data loader of ``data`` for one data-parallel rank, yielding
    :class:`~torchtitan.data.batch.Batch` ``(inputs, labels, doc_ids)``.

    ``global_batch_size`` (sequences per optimizer step) sets the number of virtual shards; None
    means ``local_batch_size * dp_world_size`` (no gradient accumulation).
    """
    section, seed = data.section, data.seed
    if local_batch_size < 1:
        raise ConfigError(f"{section}.local_batch_size: {local_batch_size} must be >= 1")
    if seq_len < 1:
        raise ConfigError(f"{section}.seq_len: {seq_len} must be >= 1")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_world_size={dp_world_size})")
    virtual_shards = global_batch_size or local_batch_size * dp_world_size
    if data.datasets:
        specs = mixture_specs(parse_entries(data.datasets, section), section)
    else:
        label = data.dataset_path or data.dataset
        specs = [
            SourceSpec(label, data.dataset, data.dataset_path, 1.0, data.text_field, data.streaming)
        ]
    windows = dict(
        window=seq_len + 1,
        seed=seed,
        shuffle=data.shuffle,
        section=section,
        vocab_size=getattr(tokenizer, "n_words", None),
        log_epochs=dp_rank == 0,
    )
    sources = [
        open_source(
            spec,
            tokenizer=tokenizer,
            virtual_shards=virtual_shards,
            split=data.split,
            section=section,
            windows=windows,
        )
        for spec in specs
    ]
    loader = HFDataLoader(
        sources,
        tokenizer=tokenizer,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        global_batch_size=virtual_shards,
        infinite=infinite,
        names=[s.name for s in specs],
        weights=[s.weight for s in specs],
        section=section,
        seed=seed,
        shuffle=data.shuffle,
        shuffle_buffer=data.shuffle_buffer,
        mask_document_starts=data.mask_document_starts,
        chat_template=data.chat_template,
    )
    _log_sources(loader, specs, data.split)
    return loader


def _log_sources(loader: HFDataLoader, specs: list[SourceSpec], split: str) -> None:
    shards = loader.shards
    where = (
        f"virtual shards {shards.start}-{shards.stop - 1} of {loader.virtual_shards} on dp rank "
        f"{loader.dp_rank} of {loader.dp_world_size}"
    )
    order = (loader.seed, loader.shuffle_buffer) if loader.shuffle else None
    lines = [
        f"{_label(src)} ({describe(src, split=split, rows=loader.rows_of(i), shuffle=order)})"
        for i, src in enumerate(loader.sources)
    ]
    template = loader.chat.loaded
    if template is not None:
        how = "its generation blocks" if template.marks_generation else "rendering each turn"
        logger.info(
            f"Conversations rendered with the chat template {template.origin}; predicted: the "
            f"assistant turns (found by {how}), the rest of each conversation is context"
        )
    if len(specs) == 1:
        logger.info(f"Dataset {lines[0]}: {where}")
        return
    logger.info(
        f"Data mixture of {len(specs)} sources, {loader.blend.shares()} of the windows: {where}"
    )
    for spec, line in zip(specs, lines, strict=True):
        logger.info(f"  {spec.name}: weight {spec.weight:g}, {line}")
