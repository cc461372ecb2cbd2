"""Pretraining data: Hugging Face ``datasets`` sources, packed into fixed-length token windows.

Sources
    Every source goes through ``datasets``: named datasets from :data:`DATASETS` (C4 and FineWeb-Edu
    streamed from the Hub, the offline ``python_docs`` corpus read from a local JSON-lines file with
    the ``json`` builder), or ``training.dataset_path``: a local file (``.json``, ``.jsonl``,
    ``.json.gz``, ``.jsonl.gz``, ``.parquet``, ``.txt``), a ``Dataset.save_to_disk`` folder, a folder
    of data files of one kind, or a Hub id ``owner/name``. Local files that are not streamed are
    converted once to Arrow in the ``datasets`` cache (``HF_DATASETS_CACHE``), then memory-mapped.

    A ``.txt`` file is one document (``sample_by="document"``): BOS/EOS tokens mark document
    boundaries, and cutting a book or an article at blank lines or line breaks would teach the model
    boundaries that are not there. Corpora whose documents are paragraphs or lines should be
    converted to JSON lines (one ``{"text": ...}`` row per document) first; so should very large
    text files, since each file is held in memory as a single row.

Packing and virtual shards
    The dataset is cut into ``V`` virtual shards with ``datasets.distributed.split_dataset_by_node``
    (contiguous row ranges for map-style datasets; whole files, or every ``V``-th row, for streamed
    ones), where ``V`` is the global batch size in sequences, whatever the data-parallel degree.
    Each shard is packed on its own: documents are tokenized with BOS and EOS and appended to the
    shard's token buffer, which is cut into consecutive, non-overlapping windows of ``seq_len + 1``
    tokens; window ``w`` gives ``input = w[:-1]``, ``label = w[1:]``. Step ``t``'s global batch is
    window ``t`` of every shard, so it is a function of (dataset, step) only: 1, 2 or 4 ranks read
    the same sequences. Data-parallel rank ``r`` of ``D`` owns shards ``[r V/D, (r+1) V/D)`` and
    serves them ``local_batch_size`` at a time (one batch per gradient-accumulation microbatch), as
    two ``int64`` tensors ``[local_batch_size, seq_len]``.

Bad rows
    A row without the text field, or whose value is not a string (a null counts as missing), stops
    training with :class:`~torchtitan.errors.DataError` naming the dataset, the row's index within
    this data-parallel rank's shard, the field and the fields the row does have. Skipping such rows
    would hide a wrong ``training.dataset_text_field`` (every row would be skipped and the loader
    would spin forever) or a broken file; pretraining data is expected to be clean, and a clear stop
    is cheaper than a silently different corpus.

Epochs
    In infinite mode each shard loops over its rows forever (the first shard of each rank logs a
    line at the end of every pass; the order is the same in every pass, nothing is shuffled). A
    non-infinite loader ends its pass when a shard has no whole window left, dropping the partial
    windows, and rewinds.

Checkpointing
    :meth:`HFDataLoader.state_dict` returns ``{"virtual_shards": V, "shard_<v>": <bytes>}`` for
    this rank's shards, the bytes being UTF-8 JSON with the shard's epoch, row position (and, for a
    streamed dataset, ``IterableDataset.state_dict()``), windows served and leftover token buffer,
    so that a fresh loader given this state yields exactly the batches the saved one would have
    yielded next. Shards are keyed by index, not by rank, so a run with another data-parallel
    degree (same global batch size) can resume from the union of the saved ranks' states. Each
    value is one opaque object so that a distributed checkpoint loads it back whole.
"""

from __future__ import annotations

import json
import logging
import re
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from torchtitan.datasets import pydoc_corpus
from torchtitan.errors import ConfigError, DataError

if TYPE_CHECKING:  # ``datasets`` takes ~0.5 s to import: only where data is read (not preflight)
    from datasets import Dataset, IterableDataset

logger = logging.getLogger("torchtitan")

STATE_VERSION = 1
_ROWS_PER_READ = 256  # rows fetched at once from a map-style dataset


class Tokenizer(Protocol):
    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]: ...


@dataclass(frozen=True)
class DatasetSpec:
    """How to load one named dataset.

    Exactly one of ``hub_path`` (a Hub dataset id, with ``config_name``) and ``local_builder`` (a
    function returning a local file or folder, loaded like ``training.dataset_path``) is set.
    ``split`` fixes the split; ``None`` reads the split asked for by the caller.
    """

    text_field: str = "text"
    streaming: bool = False
    hub_path: str | None = None
    config_name: str | None = None
    split: str | None = None
    local_builder: Callable[[], str | Path] | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if (self.hub_path is None) == (self.local_builder is None):
            raise ValueError("DatasetSpec needs exactly one of hub_path and local_builder")


DATASETS: dict[str, DatasetSpec] = {
    "c4": DatasetSpec(
        hub_path="allenai/c4",
        config_name="en",
        split="train",
        streaming=True,
        description="C4 English, train split, streamed from the Hub",
    ),
    "c4_validation": DatasetSpec(
        hub_path="allenai/c4",
        config_name="en",
        split="validation",
        streaming=True,
        description="C4 English, validation split, streamed from the Hub",
    ),
    "fineweb_edu": DatasetSpec(
        hub_path="HuggingFaceFW/fineweb-edu",
        config_name="sample-10BT",
        streaming=True,
        description="FineWeb-Edu 10B-token sample, streamed from the Hub",
    ),
    "python_docs": DatasetSpec(
        local_builder=lambda: pydoc_corpus.corpus_path(),
        streaming=False,
        description="offline debug corpus built from the Python standard library documentation",
    ),
}

# Local data file kinds: file-name ending -> ``datasets`` builder. Longest endings first.
_FILE_KINDS: dict[str, str] = {
    ".jsonl.gz": "json",
    ".json.gz": "json",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".txt": "text",
}
_SUPPORTED = (
    "a .json/.jsonl/.json.gz/.jsonl.gz, .parquet or .txt file, a folder of such files (one kind), "
    "a Dataset.save_to_disk folder, or a Hugging Face Hub id 'owner/name'"
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


def _file_kind(path: Path) -> str | None:
    name = path.name.lower()
    for ending, builder in _FILE_KINDS.items():
        if name.endswith(ending):
            return builder
    return None


def _looks_like_hub_id(path: str) -> bool:
    """``owner/name`` that is not an existing path and does not look like a local file."""
    return (
        _HUB_ID.fullmatch(path) is not None
        and not path.startswith(".")
        and _file_kind(Path(path)) is None
    )


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (
        (folder / "dataset_info.json").is_file() and (folder / "state.json").is_file()
    )


def _data_files(folder: Path) -> tuple[str, list[str]]:
    """The builder and sorted files of a folder of data files of one kind (hidden paths skipped)."""
    by_kind: dict[str, list[str]] = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).parts
        if any(part.startswith(".") for part in rel) or not p.is_file():
            continue
        kind = _file_kind(p)
        if kind is not None:
            by_kind.setdefault(kind, []).append(str(p))
    if not by_kind:
        raise ConfigError(
            f"training.dataset_path: folder '{folder}' holds no supported data files; "
            f"supported: {_SUPPORTED}"
        )
    if len(by_kind) > 1:
        found = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_kind.items()))
        raise ConfigError(
            f"training.dataset_path: folder '{folder}' mixes data file kinds ({found}); "
            f"point it at a folder of one kind; supported: {_SUPPORTED}"
        )
    ((kind, files),) = by_kind.items()
    return kind, files


def _load_local(
    path: Path, *, split: str, streaming: bool, num_shards: int
) -> Dataset | IterableDataset:
    """Load a local file or folder through ``datasets``."""
    if path.is_dir() and _is_saved_dataset(path):
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(path))
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ConfigError(
                    f"training.dataset_path: saved dataset '{path}' has no split '{split}'; "
                    f"valid splits: {', '.join(ds)}"
                )
            ds = ds[split]
        if streaming:
            # One shard per virtual shard lets split_dataset_by_node hand out whole shards.
            ds = ds.to_iterable_dataset(num_shards=max(1, min(num_shards, len(ds))))
        return ds
    if path.is_dir():
        kind, files = _data_files(path)
    else:
        kind = _file_kind(path)
        if kind is None:
            raise ConfigError(
                f"training.dataset_path: '{path}' is not a supported data file; "
                f"supported: {_SUPPORTED}"
            )
        files = [str(path)]
    extra = {"sample_by": "document"} if kind == "text" else {}
    return load_dataset(kind, data_files={split: files}, split=split, streaming=streaming, **extra)


def load_dataset(*args: Any, **kwargs: Any) -> Dataset | IterableDataset:
    """``datasets.load_dataset``, imported on first use."""
    from datasets import load_dataset as load

    return load(*args, **kwargs)


def _load_hub(
    hub_id: str, *, name: str | None, split: str, streaming: bool, key: str
) -> Dataset | IterableDataset:
    """Load a Hub dataset; a dataset that cannot be found or reached is a ConfigError."""
    from datasets.exceptions import DatasetNotFoundError

    try:
        return load_dataset(hub_id, name=name, split=split, streaming=streaming)
    except (DatasetNotFoundError, ConnectionError, FileNotFoundError) as e:
        raise ConfigError(
            f"{key}: cannot load Hugging Face Hub dataset '{hub_id}' (config {name}, split "
            f"{split}): {type(e).__name__}: {e}. Without Hub access use training.dataset = "
            f"'python_docs' or a local training.dataset_path ({_SUPPORTED})"
        ) from e


@dataclass
class _Source:
    dataset: Dataset | IterableDataset
    label: str
    text_field: str


# Dataset names upstream torchtitan configs use that this library does not define: what each is.
UPSTREAM_DATASETS = {
    "c4_test": "upstream's in-repo 2,000-row sample of C4 (tests/assets/c4_test), not shipped here",
    "c4_mini": "upstream's in-repo C4 sample (tests/assets/c4_mini), not shipped here",
    "alpaca": "the Alpaca instruction-tuning set, a fine-tuning dataset, not a pretraining corpus",
    "openwebtext": "an open re-creation of WebText, not built in here",
}


def check_dataset_config(dataset: str, dataset_path: str | None) -> None:
    """The source checks that need no loading (run before any process starts)."""
    if dataset_path is None and dataset in UPSTREAM_DATASETS:
        raise ConfigError(
            f"training.dataset: '{dataset}' is {UPSTREAM_DATASETS[dataset]}; use python_docs for an "
            "offline debug run, c4 for C4, or point training.dataset_path at a local copy (json, "
            "jsonl, parquet, txt) or a Hub id"
        )
    if dataset_path is None and dataset not in DATASETS:
        raise ConfigError(
            f"training.dataset: unknown dataset '{dataset}'; valid: "
            f"{', '.join(sorted(DATASETS))} (or set training.dataset_path to {_SUPPORTED})"
        )
    if dataset_path is not None:
        if not Path(dataset_path).expanduser().exists() and not _looks_like_hub_id(dataset_path):
            raise ConfigError(
                f"training.dataset_path: '{dataset_path}' does not exist; expected {_SUPPORTED}"
            )


def load_source(
    *,
    dataset: str,
    dataset_path: str | None,
    split: str = "train",
    text_field: str | None = None,
    streaming: bool | None = None,
    num_shards: int = 1,
) -> _Source:
    """Resolve ``training.dataset`` / ``training.dataset_path`` to an (unsharded) dataset."""
    check_dataset_config(dataset, dataset_path)
    spec = DATASETS.get(dataset)
    if dataset_path is None:
        assert spec is not None
        if spec.split is not None and split not in ("train", spec.split):
            raise ConfigError(
                f"training.dataset: '{dataset}' always reads split '{spec.split}', "
                f"but split '{split}' was asked for"
            )
        use_split = spec.split or split
        use_streaming = spec.streaming if streaming is None else streaming
        if spec.hub_path is not None:
            ds = _load_hub(
                spec.hub_path,
                name=spec.config_name,
                split=use_split,
                streaming=use_streaming,
                key="training.dataset",
            )
        else:
            assert spec.local_builder is not None
            ds = _load_local(
                Path(spec.local_builder()),
                split=use_split,
                streaming=use_streaming,
                num_shards=num_shards,
            )
        label = dataset
    else:
        local = Path(dataset_path).expanduser()
        if local.exists():
            ds = _load_local(local, split=split, streaming=bool(streaming), num_shards=num_shards)
        else:
            # Hub datasets for pretraining are large: stream them unless told otherwise.
            ds = _load_hub(
                dataset_path,
                name=None,
                split=split,
                streaming=True if streaming is None else streaming,
                key="training.dataset_path",
            )
        label = dataset_path
    field = text_field or (spec.text_field if spec is not None else "text")
    return _Source(dataset=ds, label=label, text_field=field)


class _ShardReader:
    """One virtual shard: its rows, its packing buffer and its position; yields token windows.

    Reading is lazy: a row is read (and counted in the position) only when its tokens are needed,
    so the state between two windows is exact.
    """

    def __init__(self, ds: Dataset | IterableDataset, *, index: int, loader: HFDataLoader) -> None:
        from datasets import IterableDataset

        self.index = index
        self._loader = loader
        self._ds = ds
        self.streaming = isinstance(ds, IterableDataset)
        field = loader.text_field
        if not self.streaming:
            # Reading only the text column keeps wide datasets cheap; full rows only for errors.
            self._texts = ds.select_columns([field]) if field in ds.column_names else None
        # Position: epoch (0-based), rows consumed in this epoch, windows yielded so far, leftover
        # tokens; for streamed data, a saved IterableDataset state waiting to be applied.
        self.epoch = 0
        self.row = 0
        self.windows = 0
        self.buffer: list[int] = []
        self._pending_hf_state: dict | None = None
        self._texts_iter: Iterator[str] | None = None

    def __len__(self) -> int:
        return len(self._ds)

    # ---- rows

    def _bad_row(self, index: int, row: dict[str, Any]) -> DataError:
        field = self._loader.text_field
        fields = sorted(k for k, v in row.items() if v is not None)
        value = row.get(field)
        if value is None:
            problem = f"has no field '{field}' (missing or null)"
        else:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            problem = f"field '{field}' holds {type(value).__name__} {shown}, not a string"
        return DataError(
            f"dataset '{self._loader.label}': row {index} of virtual shard {self.index} "
            f"(of {self._loader.virtual_shards}) {problem}; the row has fields {fields}; set "
            f"training.dataset_text_field to the field that holds the text"
        )

    def _map_style_texts(self) -> Iterator[str]:
        ds, n, field = self._ds, len(self._ds), self._loader.text_field
        i = self.row
        while i < n:
            if self._texts is None:
                raise self._bad_row(i, ds[i])
            texts = self._texts[i : i + _ROWS_PER_READ][field]
            for j, text in enumerate(texts):
                if not isinstance(text, str):
                    raise self._bad_row(i + j, ds[i + j])
                self.row = i + j + 1
                yield text
            i += len(texts)

    def _streamed_texts(self) -> Iterator[str]:
        ds = self._ds
        # Each pass has its own epoch number, so a loaded start state applies to its pass only
        # (datasets re-applies it to every pass with the same epoch).
        ds.set_epoch(self.epoch)
        if self._pending_hf_state is not None:
            ds.load_state_dict(self._pending_hf_state)
        self._pending_hf_state = None
        field = self._loader.text_field
        for row in ds:
            text = row.get(field)
            if not isinstance(text, str):
                raise self._bad_row(self.row, row)
            self.row += 1
            yield text

    def _next_text(self) -> str | None:
        """The next document of this pass, or None at the end of the pass."""
        if self._texts_iter is None:
            self._texts_iter = self._streamed_texts() if self.streaming else self._map_style_texts()
        return next(self._texts_iter, None)

    # ---- windows

    def next_window(self, window: int, infinite: bool) -> list[int] | None:
        """The next ``window`` tokens; None when a non-infinite pass ends (the shard rewinds)."""
        encode = self._loader.tokenizer.encode
        while len(self.buffer) < window:
            text = self._next_text()
            if text is not None:
                self.buffer.extend(encode(text, bos=True, eos=True))
                continue
            if self.row == 0:
                raise DataError(
                    f"dataset '{self._loader.label}': virtual shard {self.index} (of "
                    f"{self._loader.virtual_shards}) has no rows; use a larger dataset or a smaller "
                    "training.global_batch_size (one virtual shard per sequence of the global batch)"
                )
            self._end_pass(infinite)
            if not infinite:
                return None
        out = self.buffer[:window]
        del self.buffer[:window]
        self.windows += 1
        return out

    def _end_pass(self, infinite: bool) -> None:
        self.epoch += 1
        self.row = 0
        self._texts_iter = None
        if not infinite:
            self.buffer = []
            return
        log = logger.info if self.index == self._loader.shards[0] else logger.debug
        log(
            f"dataset {self._loader.label}: virtual shard {self.index} finished epoch "
            f"{self.epoch}, starting epoch {self.epoch + 1}"
        )

    def rewind(self) -> None:
        """Start a fresh pass from the beginning of the shard (a non-infinite loader's next iter)."""
        self._texts_iter = None
        self._pending_hf_state = None
        self.row = 0
        self.buffer = []

    # ---- state

    def state(self) -> bytes:
        hf_state = None
        if self.streaming and self.row > 0:
            hf_state = self._pending_hf_state or self._ds.state_dict()
        state = {
            "version": STATE_VERSION,
            "dataset": self._loader.label,
            "streaming": self.streaming,
            "epoch": self.epoch,
            "row": self.row,
            "windows": self.windows,
            "buffer": self.buffer,
            "hf_state": hf_state,
        }
        return json.dumps(state, separators=(",", ":")).encode()

    def load(self, blob: bytes) -> None:
        state = json.loads(blob)
        label = self._loader.label
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
        if state["dataset"] != label and self.index == self._loader.shards[0]:
            logger.warning(
                f"data loader checkpoint was saved for dataset '{state['dataset']}', "
                f"now reading '{label}'; resuming at the saved position anyway"
            )
        if not self.streaming and state["row"] > len(self._ds):
            raise ConfigError(
                f"data loader checkpoint: saved at row {state['row']} of virtual shard "
                f"{self.index}, but dataset '{label}' has {len(self._ds)} rows there; did the "
                "data change?"
            )
        self.epoch = state["epoch"]
        self.row = state["row"]
        self.windows = state["windows"]
        self.buffer = list(state["buffer"])
        self._texts_iter = None
        self._pending_hf_state = state["hf_state"] if self.streaming and self.row > 0 else None


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
        source: _Source,
        *,
        tokenizer: Tokenizer,
        local_batch_size: int,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        global_batch_size: int | None = None,
        infinite: bool = True,
    ) -> None:
        self.label = source.label
        self.text_field = source.text_field
        self.tokenizer = tokenizer
        self.local_batch_size = local_batch_size
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        per_step = local_batch_size * dp_world_size
        self.virtual_shards = global_batch_size or per_step
        if self.virtual_shards % per_step:
            raise ConfigError(
                f"training.global_batch_size: {self.virtual_shards} must be a multiple of "
                f"training.local_batch_size x data-parallel degree ({per_step})"
            )
        per_rank = self.virtual_shards // dp_world_size
        self.shards = range(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        ds = source.dataset
        from datasets import IterableDataset
        from datasets.distributed import split_dataset_by_node

        if not isinstance(ds, IterableDataset) and len(ds) < self.virtual_shards:
            raise DataError(
                f"dataset '{self.label}' has {len(ds)} rows, fewer than its "
                f"{self.virtual_shards} virtual shards (one per sequence of the global batch); use "
                "a larger dataset or a smaller training.global_batch_size"
            )
        self._readers = [
            _ShardReader(
                split_dataset_by_node(ds, rank=v, world_size=self.virtual_shards)
                if self.virtual_shards > 1
                else ds,
                index=v,
                loader=self,
            )
            for v in self.shards
        ]
        self.streaming = self._readers[0].streaming
        self._next_group = 0  # which local_batch_size block of this rank's shards reads next

    def restart(self) -> None:
        """Read from the beginning again (a validation pass that stopped part-way)."""
        for r in self._readers:
            r.rewind()
        self._next_group = 0

    @property
    def num_rows(self) -> int | None:
        """Rows in this rank's shards (None for streamed data)."""
        return None if self.streaming else sum(len(r) for r in self._readers)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        window = self.seq_len + 1
        n = self.local_batch_size
        groups = len(self._readers) // n
        while True:
            readers = self._readers[self._next_group * n : (self._next_group + 1) * n]
            rows = [r.next_window(window, self.infinite) for r in readers]
            if any(w is None for w in rows):
                for r in self._readers:
                    r.rewind()
                self._next_group = 0
                return
            self._next_group = (self._next_group + 1) % groups
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
) -> HFDataLoader:
    """The training data loader for one data-parallel rank.

    ``global_batch_size`` (sequences per optimizer step) sets the number of virtual shards; None
    means ``local_batch_size * dp_world_size`` (no gradient accumulation).

    ``text_field`` / ``streaming`` ``None`` take the named dataset's defaults (``"text"``; local
    files are not streamed, Hub datasets are).
    """
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size: {local_batch_size} must be >= 1")
    if seq_len < 1:
        raise ConfigError(f"training.seq_len: {seq_len} must be >= 1")
    if not 0 <= dp_rank < dp_world_size:
        raise ValueError(f"dp_rank {dp_rank} must be in [0, dp_world_size={dp_world_size})")
    virtual_shards = global_batch_size or local_batch_size * dp_world_size
    source = load_source(
        dataset=dataset,
        dataset_path=dataset_path,
        split=split,
        text_field=text_field,
        streaming=streaming,
        num_shards=virtual_shards,
    )
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
    kind = "streamed" if loader.streaming else f"{loader.num_rows:,} rows on this rank"
    shards = loader.shards
    logger.info(
        f"Dataset {source.label} (split {split}, text field '{source.text_field}', {kind}): "
        f"virtual shards {shards.start}-{shards.stop - 1} of {loader.virtual_shards} on dp rank "
        f"{dp_rank} of {dp_world_size}"
    )
    return loader
