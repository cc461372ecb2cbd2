"""Data sources: a dataset name or path resolved to an unsharded Hugging Face ``datasets`` dataset.

Every source goes through ``datasets``: named datasets from :data:`DATASETS` (C4 and FineWeb-Edu
streamed from the Hub, the offline ``python_docs`` corpus read from a local JSON-lines file with
the ``json`` builder), or ``<section>.dataset_path``: a local file (``.json``, ``.jsonl``,
``.json.gz``, ``.jsonl.gz``, ``.parquet``, ``.txt``), a ``Dataset.save_to_disk`` folder, a folder
of data files of one kind, or a Hub id ``owner/name``. Local files that are not streamed are
converted once to Arrow in the ``datasets`` cache (``HF_DATASETS_CACHE``), then memory-mapped.

A ``.txt`` file is one document (``sample_by="document"``): BOS/EOS tokens mark document
boundaries, and cutting a book or an article at blank lines or line breaks would teach the model
boundaries that are not there. Corpora whose documents are paragraphs or lines should be
converted to JSON lines (one ``{"text": ...}`` row per document) first; so should very large
text files, since each file is held in memory as a single row.

``section`` arguments name the config section the settings came from (``training`` or
``validation``), so that error messages name the key the user set. A JSON file that cannot be read
is named with its first bad line (:func:`bad_json_line`), at load or part-way through a stream
(:func:`read_error`). A Hub dataset is loaded only after the Hub answered one request within
:data:`HUB_PROBE_SECONDS` (:func:`hub_unreachable`); otherwise only the ``datasets`` cache is
tried, so that a machine without a network gets its one line in seconds.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchtitan.data import pydoc_corpus
from torchtitan.data.indexed import indexed_prefixes
from torchtitan.data.remote_files import check_remote_data, is_url
from torchtitan.errors import ConfigError, DataError

if TYPE_CHECKING:  # ``datasets`` takes ~0.5 s to import: only where data is read (not preflight)
    from datasets import Dataset, IterableDataset


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

# Dataset names upstream torchtitan configs use that this library does not define: what each is.
UPSTREAM_DATASETS = {
    "c4_test": "upstream's in-repo 2,000-row sample of C4 (tests/assets/c4_test), not shipped here",
    "c4_mini": "upstream's in-repo C4 sample (tests/assets/c4_mini), not shipped here",
    "alpaca": "the Alpaca instruction-tuning set, a fine-tuning dataset, not a pretraining corpus",
    "openwebtext": "an open re-creation of WebText, not built in here",
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
    "a Dataset.save_to_disk folder, a pretokenized .bin/.idx corpus (prefix, file or folder), or "
    "a Hugging Face Hub id 'owner/name'"
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


@dataclass
class Source:
    """A resolved source: the unsharded dataset, its name in messages and its text column (or
    its column of token ids, ``input_ids``, for a dataset tokenized already); ``json_files``:
    the local JSON-lines files it reads, and ``key`` the setting that named them, so that a file
    that cannot be read is named with its bad line (:func:`read_error`)."""

    dataset: Dataset | IterableDataset
    label: str
    text_field: str
    json_files: tuple[str, ...] = ()
    key: str = "training.dataset_path"


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


def _data_files(folder: Path, *, key: str) -> tuple[str, list[str]]:
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
            f"{key}: folder '{folder}' holds no supported data files; supported: {_SUPPORTED}"
        )
    if len(by_kind) > 1:
        found = ", ".join(f"{len(v)} {k}" for k, v in sorted(by_kind.items()))
        raise ConfigError(
            f"{key}: folder '{folder}' mixes data file kinds ({found}); "
            f"point it at a folder of one kind; supported: {_SUPPORTED}"
        )
    ((kind, files),) = by_kind.items()
    return kind, files


def _load_local(
    path: Path, *, split: str, streaming: bool, num_shards: int, key: str
) -> tuple[Dataset | IterableDataset, tuple[str, ...]]:
    """Load a local file or folder through ``datasets``; also the JSON files it reads."""
    if path.is_dir() and _is_saved_dataset(path):
        from datasets import DatasetDict, load_from_disk

        try:
            ds = load_from_disk(str(path))
        except (IndexError, ValueError, OSError) as e:  # an empty or damaged save
            raise DataError(
                f"{key}: cannot load saved dataset '{path}' "
                f"({type(e).__name__}: {str(e)[:200] or 'it holds no data files'}); is it empty?"
            ) from None
        if isinstance(ds, DatasetDict):
            if split not in ds:
                raise ConfigError(
                    f"{key}: saved dataset '{path}' has no split '{split}'; "
                    f"valid splits: {', '.join(ds)}"
                )
            ds = ds[split]
        if len(ds) == 0:
            raise DataError(f"dataset '{path}' is empty: the saved dataset has no rows")
        if streaming:
            # One shard per virtual shard lets split_dataset_by_node hand out whole shards.
            ds = ds.to_iterable_dataset(num_shards=max(1, min(num_shards, len(ds))))
        return ds, ()
    if path.is_dir():
        kind, files = _data_files(path, key=key)
    else:
        kind = _file_kind(path)
        if kind is None:
            raise ConfigError(
                f"{key}: '{path}' is not a supported data file; supported: {_SUPPORTED}"
            )
        files = [str(path)]
    from datasets.exceptions import DatasetGenerationError

    if all(os.path.getsize(f) == 0 for f in files):
        raise DataError(f"dataset '{path}' is empty: its data files hold no bytes")
    json_files = tuple(files) if kind == "json" else ()
    if json_files:  # its error line names a row of a block; ours names the file's line
        logging.getLogger(_JSON_READER_LOGGER).setLevel(logging.CRITICAL)
    extra = {"sample_by": "document"} if kind == "text" else {}
    try:
        ds = load_dataset(
            kind, data_files={split: files}, split=split, streaming=streaming, **extra
        )
    except (StopIteration, ValueError, OSError, DatasetGenerationError) as e:  # a bad file
        bad = bad_json_line(json_files, key)
        if bad is not None:
            raise bad from None
        cause = e.__cause__ if isinstance(e, DatasetGenerationError) and e.__cause__ else e
        first = _first_line(cause)[:200]
        raise DataError(
            f"{key}: the '{kind}' reader of the datasets library cannot read "
            f"'{path}' ({type(cause).__name__}: {first or 'no rows'}); check the file"
        ) from None
    return ds, json_files


_JSON_READER_LOGGER = "datasets.packaged_modules.json.json"


def _json_problem(lines: Iterator[bytes]) -> tuple[int, str] | None:
    """The 1-based number of the first line that is not one JSON object, and why; None if
    every non-blank line is one."""
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line.rstrip(b"\r\n").decode("utf-8-sig" if n == 1 else "utf-8"))
        except UnicodeDecodeError as e:
            return n, f"not UTF-8 text: byte {e.object[e.start]:#04x} at column {e.start + 1}"
        except json.JSONDecodeError as e:
            return n, f"not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}"
        if not isinstance(value, dict):
            return n, f"a JSON {type(value).__name__}, not an object"
    return None


def _json_document_problem(data: bytes) -> tuple[int, str] | None:
    """A ``.json`` file that is one document (an array of rows): the line of its first error."""
    try:
        json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        return data.count(b"\n", 0, e.start) + 1, "not UTF-8 text"
    except json.JSONDecodeError as e:
        return e.lineno, f"not valid JSON: {e.msg.removesuffix(' at')} at column {e.colno}"
    return None


def bad_json_line(files: tuple[str, ...], key: str) -> DataError | None:
    """The first line of ``files`` (JSON lines, or one JSON document) that cannot be read, as a
    DataError naming the file and the 1-based line; None when every file reads (or cannot be
    opened: that is reported otherwise)."""
    for path in files:
        opener: Callable[..., Any] = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rb") as f:
                head = f.read(1 << 16)
                first = next((line.strip() for line in head.splitlines() if line.strip()), b"")
                if first[:1] == b"[" or first == b"{":  # one JSON document, not JSON lines
                    problem = _json_document_problem(head + f.read())
                else:
                    f.seek(0)
                    problem = _json_problem(iter(f))
        except (OSError, EOFError):
            continue
        if problem is not None:
            n, why = problem
            return DataError(f"{key}: '{path}' line {n} is {why}; fix or remove that line")
    return None


def read_error(source: Source, e: BaseException) -> DataError:
    """A source that failed part-way through reading (a streamed file, say): the bad line of a
    JSON file when there is one, else the reader's own first line."""
    bad = bad_json_line(source.json_files, source.key)
    if bad is not None:
        return bad
    first = _first_line(e)[:200]
    return DataError(
        f"dataset '{source.label}': cannot be read ({type(e).__name__}: {first}); check the data"
    )


def load_dataset(*args: Any, **kwargs: Any) -> Dataset | IterableDataset:
    """``datasets.load_dataset``, imported on first use."""
    from datasets import load_dataset as load

    return load(*args, **kwargs)


HUB_PROBE_SECONDS = 5.0  # how long the Hub may take to answer before it counts as unreachable


def hub_unreachable(timeout: float = HUB_PROBE_SECONDS) -> str | None:
    """Why the Hugging Face Hub cannot be used (offline mode, or no answer from ``HF_ENDPOINT``
    within ``timeout`` seconds), or None when it answers. One request, no retries: ``datasets``
    would retry for a minute before saying the same."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    endpoint = constants.ENDPOINT
    answer: list[str | None] = []

    def probe() -> None:
        try:
            request = urllib.request.Request(endpoint, method="HEAD")
            urllib.request.urlopen(request, timeout=timeout).close()
            answer.append(None)
        except urllib.error.HTTPError:  # it answered
            answer.append(None)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            answer.append(
                f"no answer from {endpoint}: {getattr(reason, 'strerror', None) or reason}"
            )

    thread = threading.Thread(target=probe, daemon=True)  # a DNS lookup ignores the timeout
    thread.start()
    thread.join(timeout + 1)
    return answer[0] if answer else f"no answer from {endpoint} within {timeout:g} s"


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    """``datasets`` and ``huggingface_hub`` in offline mode (a cached copy, or a quick error)."""
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


_LOCAL_COPY = "a local copy (a .jsonl, .parquet or .txt file, or a folder of them)"


def _load_hub(
    hub_id: str, *, name: str | None, split: str, streaming: bool, key: str, dataset: str | None
) -> Dataset | IterableDataset:
    """Load a Hub dataset; a dataset that cannot be found or reached is a ConfigError naming
    ``key`` (``dataset``: the named dataset that reads it, if any). When the Hub cannot be
    reached, only the ``datasets`` cache is tried, so that the error comes in seconds."""
    from datasets.exceptions import DatasetNotFoundError

    section = key.split(".")[0]
    unreachable = hub_unreachable()
    try:
        with _hub_offline() if unreachable else contextlib.nullcontext():
            return load_dataset(hub_id, name=name, split=split, streaming=streaming)
    except (DatasetNotFoundError, ConnectionError, FileNotFoundError) as e:
        if unreachable and dataset is not None:
            raise ConfigError(
                f"{key}: '{dataset}' is {hub_id} (config {name}, split {split}) on the Hugging "
                f"Face Hub, which cannot be used here ({unreachable}) and is not in the datasets "
                f"cache; set {section}.dataset_path to {_LOCAL_COPY}, or {key} = 'python_docs'"
            ) from None
        if unreachable:
            raise ConfigError(
                f"{key}: '{hub_id}' is not a local path, and the Hugging Face Hub that holds it "
                f"cannot be used here ({unreachable}); give {_LOCAL_COPY}"
            ) from None
        raise ConfigError(
            f"{key}: cannot load Hugging Face Hub dataset '{hub_id}' (config {name}, "
            f"split {split}): {type(e).__name__}: {_first_line(e)}. Without Hub access use "
            f"{section}.dataset = 'python_docs' or a local {section}.dataset_path ({_SUPPORTED})"
        ) from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def check_dataset_config(
    dataset: str, dataset_path: str | None, section: str = "training", entry: str | None = None
) -> None:
    """The source checks that need no loading (run before any process starts). ``entry`` names a
    mixture entry (``training.datasets[1]``) whose ``dataset`` / ``path`` keys messages name."""
    name_key = f"{entry}.dataset" if entry else f"{section}.dataset"
    path_key = f"{entry}.path" if entry else f"{section}.dataset_path"
    if dataset_path is None and dataset in UPSTREAM_DATASETS:
        raise ConfigError(
            f"{name_key}: '{dataset}' is {UPSTREAM_DATASETS[dataset]}; use python_docs for "
            f"an offline debug run, c4 for C4, or point {path_key} at a local copy "
            "(json, jsonl, parquet, txt) or a Hub id"
        )
    if dataset_path is None and dataset not in DATASETS:
        raise ConfigError(
            f"{name_key}: unknown dataset '{dataset}'; valid: "
            f"{', '.join(sorted(DATASETS))} (or set {path_key} to {_SUPPORTED})"
        )
    if dataset_path is not None:
        if is_url(dataset_path):  # copied to the local cache when loaded (remote_files)
            check_remote_data(dataset_path, path_key)
            return
        if indexed_prefixes(dataset_path) is not None:
            return
        if not Path(dataset_path).expanduser().exists() and not _looks_like_hub_id(dataset_path):
            raise ConfigError(f"{path_key}: '{dataset_path}' does not exist; expected {_SUPPORTED}")


def _load_named(
    dataset: str, *, split: str, streaming: bool | None, num_shards: int, section: str
) -> tuple[Dataset | IterableDataset, tuple[str, ...]]:
    """A dataset of :data:`DATASETS` (``{section}.dataset``), and the JSON files it reads."""
    spec = DATASETS[dataset]
    if spec.split is not None and split not in ("train", spec.split):
        raise ConfigError(
            f"{section}.dataset: '{dataset}' always reads split '{spec.split}', "
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
            key=f"{section}.dataset",
            dataset=dataset,
        )
        return ds, ()
    assert spec.local_builder is not None
    return _load_local(
        Path(spec.local_builder()),
        split=use_split,
        streaming=use_streaming,
        num_shards=num_shards,
        key=f"{section}.dataset",
    )


def _load_path(
    dataset_path: str, *, split: str, streaming: bool | None, num_shards: int, section: str
) -> tuple[Dataset | IterableDataset, tuple[str, ...]]:
    """A local file or folder, or a Hub id (``{section}.dataset_path``), and the JSON files
    it reads."""
    key = f"{section}.dataset_path"
    local = Path(dataset_path).expanduser()
    if local.exists():
        return _load_local(
            local, split=split, streaming=bool(streaming), num_shards=num_shards, key=key
        )
    # Hub datasets for pretraining are large: stream them unless told otherwise.
    ds = _load_hub(
        dataset_path,
        name=None,
        split=split,
        streaming=True if streaming is None else streaming,
        key=key,
        dataset=None,
    )
    return ds, ()


def load_source(
    *,
    dataset: str,
    dataset_path: str | None,
    split: str = "train",
    text_field: str | None = None,
    streaming: bool | None = None,
    num_shards: int = 1,
    section: str = "training",
) -> Source:
    """Resolve ``{section}.dataset`` / ``{section}.dataset_path`` to an (unsharded) dataset."""
    check_dataset_config(dataset, dataset_path, section)
    if dataset_path is None:
        ds, json_files = _load_named(
            dataset, split=split, streaming=streaming, num_shards=num_shards, section=section
        )
        label, key = dataset, f"{section}.dataset"
    else:
        ds, json_files = _load_path(
            dataset_path, split=split, streaming=streaming, num_shards=num_shards, section=section
        )
        label, key = dataset_path, f"{section}.dataset_path"
    spec = DATASETS.get(dataset)
    field = text_field or (spec.text_field if spec is not None else "text")
    columns = ds.column_names or []
    if text_field is None and field not in columns and TOKEN_FIELD in columns:
        field = TOKEN_FIELD  # a dataset tokenized already
    elif text_field is None and field not in columns and MESSAGES_FIELD in columns:
        field = MESSAGES_FIELD  # conversations
    return Source(dataset=ds, label=label, text_field=field, json_files=json_files, key=key)


TOKEN_FIELD = "input_ids"  # the column of a dataset that holds token ids rather than text
MESSAGES_FIELD = "messages"  # the column of a chat dataset that holds its conversations


def holds_conversations(source: Source) -> bool:
    """Whether a map-style source's first row holds a conversation (a list of messages) in its
    field (``datasets`` declares the column a list of records, or of JSON values when the
    messages' keys differ, so the row is read)."""
    from torchtitan.data.chat import is_conversation

    ds = source.dataset
    if not len(ds) or source.text_field not in (ds.column_names or []):
        return False
    return is_conversation(ds[0][source.text_field])


def holds_token_ids(source: Source) -> bool:
    """Whether the source's field is a list of integers (token ids) rather than text."""
    features = getattr(source.dataset, "features", None) or {}
    feature = features.get(source.text_field)
    inner = getattr(feature, "feature", None)  # Sequence(Value("int32")) or List(Value(...))
    return inner is not None and str(getattr(inner, "dtype", "")).startswith(("int", "uint"))
