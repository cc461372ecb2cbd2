"""The pretraining data loader: a source cut into virtual shards, served as packed token batches.

Virtual shards
    The dataset is cut into ``V`` virtual shards with ``datasets.distributed.split_dataset_by_node``
    (contiguous row ranges for map-style datasets; whole files, or every ``V``-th row, for streamed
    ones), where ``V`` is the global batch size in sequences, whatever the data-parallel degree.
    Each shard is packed on its own (:class:`~torchtitan.datasets.reader.ShardReader`): window
    ``w`` of ``seq_len + 1`` tokens gives ``input = w[:-1]``, ``label = w[1:]``. Step ``t``'s global
    batch is window ``t`` of every shard, so it is a function of (dataset, step) only: 1, 2 or 4
    ranks read the same sequences. Data-parallel rank ``r`` of ``D`` owns shards
    ``[r V/D, (r+1) V/D)`` and serves them ``local_batch_size`` at a time (one batch per
    gradient-accumulation microbatch), as two ``int64`` tensors ``[local_batch_size, seq_len]``.

Epochs
    In infinite mode iteration never ends. A non-infinite loader ends its pass when a shard has no
    whole window left, dropping the partial windows, and rewinds.

Checkpointing
    :meth:`HFDataLoader.state_dict` returns ``{"virtual_shards": V, "shard_<v>": <bytes>}`` for
    this rank's shards, the bytes being each shard's :meth:`~ShardReader.state`, so that a fresh
    loader given this state yields exactly the batches the saved one would have yielded next.
    Shards are keyed by index, not by rank, so a run with another data-parallel degree (same global
    batch size) can resume from the union of the saved ranks' states. Each value is one opaque
    object so that a distributed checkpoint loads it back whole.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from torchtitan.config_manager import global_batch
from torchtitan.datasets.indexed import IndexedCorpus, indexed_prefixes, open_corpus
from torchtitan.datasets.reader import ShardReader, Tokenizer
from torchtitan.datasets.sources import Source, load_source
from torchtitan.datasets.token_windows import InMemoryDocs, TokenWindows, WindowRow
from torchtitan.errors import ConfigError, DataError
from torchtitan.log import logger


class HFDataLoader:
    """Packed ``(inputs, labels)`` batches for one data-parallel rank; checkpointable.

    The dataset is cut into ``virtual_shards`` shards (``split_dataset_by_node(ds, v, V)``), one per
    sequence of the global batch, however many data-parallel ranks there are. Each shard is packed
    on its own and gives one ``seq_len + 1`` window per training step, so the global batch of step
    ``t`` is window ``t`` of every shard: the same for 1, 2 or 4 ranks. DP rank ``r`` of ``D``
    owns the contiguous shards ``[r V/D, (r+1) V/D)``; its ``V / (D * local_batch_size)`` batches
    per step (gradient-accumulation microbatches) take ``local_batch_size`` of them each, in order.

    Iterating continues from the current position (a fresh loader starts at the beginning, a loader
    given a ``load_state_dict`` starts where the saved one stopped). In infinite mode iteration
    never ends; otherwise one ``iter()`` is one pass, ending when a shard runs out of whole windows,
    after which the loader rewinds, so the next ``iter()`` is a fresh pass.
    """

    def __init__(
        self,
        source: Source | TokenWindows,
        *,
        tokenizer: Tokenizer,
        local_batch_size: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        global_batch_size: int | None = None,
        infinite: bool = True,
    ) -> None:
        self.label = source.store.label if isinstance(source, TokenWindows) else source.label
        self.text_field = None if isinstance(source, TokenWindows) else source.text_field
        self.tokenizer = tokenizer
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.virtual_shards, _ = global_batch(
            local_batch_size, global_batch_size or -1, dp_world_size
        )
        per_rank = self.virtual_shards // dp_world_size
        self.shards = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        self.source = source
        self.streaming = False
        self._readers: list[ShardReader] | list[WindowRow]
        if isinstance(source, TokenWindows):
            self._readers = [
                WindowRow(source, index=v, virtual_shards=self.virtual_shards, infinite=infinite,
                          first_on_rank=v == self.shards[0])
                for v in self.shards
            ]  # fmt: skip
        else:
            self._readers = self._shard_readers(source, tokenizer, seq_len + 1)
        self._next_group = 0  # which local_batch_size block of this rank's shards reads next

    def _shard_readers(
        self, source: Source, tokenizer: Tokenizer, window: int
    ) -> list[ShardReader]:
        """One reader per virtual shard of this rank: rows split with ``split_dataset_by_node``."""
        ds = source.dataset
        from datasets import IterableDataset
        from datasets.distributed import split_dataset_by_node

        self.streaming = isinstance(ds, IterableDataset)
        if not self.streaming and len(ds) < self.virtual_shards:
            raise DataError(
                f"dataset '{self.label}' has {len(ds)} rows, fewer than its "
                f"{self.virtual_shards} virtual shards (one per sequence of the global batch); use "
                "a larger dataset or a smaller training.global_batch_size"
            )
        return [
            ShardReader(
                split_dataset_by_node(ds, rank=v, world_size=self.virtual_shards)
                if self.virtual_shards > 1
                else ds,
                index=v,
                virtual_shards=self.virtual_shards,
                tokenizer=tokenizer,
                text_field=source.text_field,
                label=self.label,
                window=window,
                infinite=self.infinite,
                streaming=self.streaming,
                first_on_rank=v == self.shards[0],
            )
            for v in self.shards
        ]

    def restart(self) -> None:
        """Read from the beginning again (a validation pass that stopped part-way)."""
        for r in self._readers:
            r.rewind()
        self._next_group = 0

    @property
    def num_rows(self) -> int | None:
        """Rows in this rank's shards (None for streamed or pretokenized data)."""
        if self.streaming or isinstance(self.source, TokenWindows):
            return None
        return sum(len(r) for r in self._readers)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        n = self.local_batch_size
        groups = len(self._readers) // n
        while True:
            readers = self._readers[self._next_group * n : (self._next_group + 1) * n]
            rows = [r.next_window() for r in readers]
            if any(w is None for w in rows):
                for r in self._readers:
                    r.rewind()
                self._next_group = 0
                return
            self._next_group = (self._next_group + 1) % groups
            if isinstance(rows[0], np.ndarray):
                chunk = torch.from_numpy(np.stack(rows))
            else:
                flat_rows = [t for w in rows for t in w]
                # array -> tensor is several times faster than torch.tensor(list)
                chunk = torch.frombuffer(array("q", flat_rows), dtype=torch.long).view(n, window)
            yield chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    # ---- checkpointing

    def state_dict(self) -> dict[str, Any]:
        """``{"virtual_shards": V, "shard_<v>": UTF-8 JSON bytes}`` for this rank's shards."""
        state: dict[str, Any] = {"virtual_shards": self.virtual_shards}
        for r in self._readers:
            state[f"shard_{r.index}"] = r.state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from a saved state; call before iterating (or take a new ``iter()``).

        The state may come from a run with another data-parallel degree: shards are keyed by their
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
                f"training.global_batch_size = {saved}, or start the data from scratch"
            )
        missing = [v for v in self.shards if f"shard_{v}" not in state_dict]
        if missing:
            found = sorted(k for k in state_dict if k.startswith("shard_"))
            raise ConfigError(
                f"data loader checkpoint: no state for virtual shard(s) {missing} of dp rank "
                f"{self.dp_rank} (found: {', '.join(found) or 'none'})"
            )
        for r in self._readers:
            r.load(state_dict[f"shard_{r.index}"])
        # Groups advance in order within a step: the next group is the first one behind group 0.
        n = self.local_batch_size
        counts = [self._readers[g * n].windows for g in range(len(self._readers) // n)]
        self._next_group = next((g for g, c in enumerate(counts) if c < counts[0]), 0)


def _too_few_rows(source: Source, virtual_shards: int) -> bool:
    """A map-style dataset with fewer rows than the global batch cannot be split by rows."""
    from datasets import IterableDataset

    return not isinstance(source.dataset, IterableDataset) and len(source.dataset) < virtual_shards


def _tokenize_all(source: Source, tokenizer: Tokenizer) -> InMemoryDocs:
    """Every document of a small map-style dataset, tokenized with BOS and EOS."""
    reader = ShardReader(
        source.dataset, index=0, virtual_shards=1, tokenizer=tokenizer,
        text_field=source.text_field, label=source.label, window=1, infinite=False,
        streaming=False, first_on_rank=False,
    )  # fmt: skip
    docs = [
        np.asarray(tokenizer.encode(t, bos=True, eos=True), dtype=np.int64) for t in reader.texts()
    ]
    return InMemoryDocs(docs, label=source.label)


def build_hf_dataloader(
    *,
    dataset: str,
    dataset_path: str | None,
    tokenizer: Tokenizer,
    local_batch_size: int,
    seq_len: int,
    dp_rank: int = 0,
    dp_world_size: int = 1,
    global_batch_size: int | None = None,
    infinite: bool = True,
    text_field: str | None = None,
    streaming: bool | None = None,
    split: str = "train",
    section: str = "training",
    seed: int = 0,
    shuffle: bool = False,
) -> HFDataLoader:
    """The data loader for one data-parallel rank.

    ``global_batch_size`` (sequences per optimizer step) sets the number of virtual shards; None
    means ``local_batch_size * dp_world_size`` (no gradient accumulation).

    ``text_field`` / ``streaming`` ``None`` take the named dataset's defaults (``"text"``; local
    files are not streamed, Hub datasets are).

    ``section`` is the config section the settings came from (``"training"``, or
    ``"validation"`` for the validation loader): messages about ``dataset``, ``dataset_path``,
    ``local_batch_size`` and ``seq_len`` name keys of that section.
    """
    if local_batch_size < 1:
        raise ConfigError(f"{section}.local_batch_size: {local_batch_size} must be >= 1")
    if seq_len < 1:
        raise ConfigError(f"{section}.seq_len: {seq_len} must be >= 1")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_world_size={dp_world_size})")
    virtual_shards = global_batch_size or local_batch_size * dp_world_size
    source: Source | TokenWindows
    windows = dict(window=seq_len + 1, seed=seed, shuffle=shuffle, section=section,
                   vocab_size=getattr(tokenizer, "n_words", None), log_epochs=dp_rank == 0)  # fmt: skip
    if dataset_path is not None and indexed_prefixes(dataset_path) is not None:
        fingerprint = getattr(tokenizer, "fingerprint", None)
        corpus = open_corpus(
            dataset_path, tokenizer=fingerprint() if fingerprint else None, section=section
        )
        source = TokenWindows(corpus, **windows)
    else:
        source = load_source(
            dataset=dataset,
            dataset_path=dataset_path,
            split=split,
            text_field=text_field,
            streaming=streaming,
            num_shards=virtual_shards,
            section=section,
        )
        if _too_few_rows(source, virtual_shards):
            source = TokenWindows(_tokenize_all(source, tokenizer), **windows)
    loader = HFDataLoader(
        source,
        tokenizer=tokenizer,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        global_batch_size=virtual_shards,
        infinite=infinite,
    )
    shards = loader.shards
    if isinstance(source, TokenWindows):
        order = f"shuffled with seed {seed}" if shuffle else "in stored order"
        kind = "pretokenized" if isinstance(source.store, IndexedCorpus) else (
            "fewer rows than the global batch: tokenized whole, cut by tokens"
        )  # fmt: skip
        what = (
            f"{kind}, {len(source.store.doc_lengths):,} documents, {source.num_tokens:,} "
            f"tokens, {source.per_epoch:,} windows per epoch, {order}"
        )
    else:
        kind = "streamed" if loader.streaming else f"{loader.num_rows:,} rows on this rank"
        what = f"split {split}, text field '{source.text_field}', {kind}"
    logger.info(
        f"Dataset {loader.label} ({what}): virtual shards {shards.start}-{shards.stop - 1} of "
        f"{loader.virtual_shards} on dp rank {dp_rank} of {dp_world_size}"
    )
    return loader
