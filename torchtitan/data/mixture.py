"""The sources of a run: one dataset, or a weighted mixture (``[[training.datasets]]``), each opened
as text to tokenize on the fly or as a stream of pretokenized windows.

A mixture entry is a TOML table (or, on the command line, JSON, or ``name_or_path:weight`` pairs
separated by commas)::

    [[training.datasets]]
    path = "/data/web_corpus"        # anything training.dataset_path takes
    weight = 0.7
    name = "web"                     # optional: the name in metrics and messages

    [[training.datasets]]
    dataset = "python_docs"          # or a named dataset
    weight = 0.3
    text_field = "text"              # optional, as training.dataset_text_field
    streaming = false                # optional, as training.dataset_streaming

Weights are relative shares of the windows (so of the tokens) of every step's global batch.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.data.indexed import IndexedCorpus, indexed_prefixes, open_corpus
from torchtitan.data.pydoc_corpus import default_cache_dir
from torchtitan.data.reader import ShardReader, Tokenizer
from torchtitan.data.remote_files import is_url, local_copy
from torchtitan.data.sources import (
    DATASETS,
    Source,
    check_dataset_config,
    holds_conversations,
    holds_token_ids,
    load_source,
)
from torchtitan.data.token_windows import HFTokenDocs, InMemoryDocs, TokenWindows
from torchtitan.errors import ConfigError, DataError

_ENTRY_KEYS = {"dataset", "path", "weight", "name", "text_field", "streaming"}


@dataclass(frozen=True)
class SourceSpec:
    """One source of the run: a named ``dataset`` or a ``path``, its weight and its name."""

    name: str
    dataset: str
    path: str | None
    weight: float = 1.0
    text_field: str | None = None
    streaming: bool | None = None
    path_key: str | None = None  # the key that set ``path`` (for errors)


def parse_entries(raw: Any, section: str = "training") -> list[dict[str, Any]]:
    """``{section}.datasets`` as written (TOML tables, JSON text or ``a:0.7,b:0.3``) -> tables."""
    key = f"{section}.datasets"
    if isinstance(raw, str):
        text = raw.strip()
        if text.startswith("["):
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{key}: not valid JSON ({e})") from None
        else:
            raw = [_pair(p.strip(), key) for p in text.split(",") if p.strip()]
    if not isinstance(raw, list) or not all(isinstance(e, dict) for e in raw):
        raise ConfigError(f"{key}: expected a list of tables ([[{key}]] in TOML)")
    return raw


def _pair(text: str, key: str) -> dict[str, Any]:
    where, _, weight = text.rpartition(":")
    if not where:
        raise ConfigError(f"{key}: '{text}' is not name_or_path:weight")
    try:
        w = float(weight)
    except ValueError:
        raise ConfigError(f"{key}: weight '{weight}' of '{where}' is not a number") from None
    return {"dataset": where, "weight": w} if where in DATASETS else {"path": where, "weight": w}


def mixture_specs(entries: list[dict[str, Any]], section: str = "training") -> list[SourceSpec]:
    """Checked :class:`SourceSpec` of each entry; every problem is one line naming the entry."""
    specs = [_spec(e, i, section) for i, e in enumerate(entries)]
    if not specs:
        raise ConfigError(f"{section}.datasets: the mixture lists no sources")
    if sum(s.weight for s in specs) <= 0:
        raise ConfigError(f"{section}.datasets: the weights are all zero; give a source weight > 0")
    names = [s.name for s in specs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(
            f"{section}.datasets: two entries are named {dup[0]!r}; give each a distinct name"
        )
    return specs


def _spec(entry: dict[str, Any], i: int, section: str) -> SourceSpec:
    key = f"{section}.datasets[{i}]"
    unknown = sorted(set(entry) - _ENTRY_KEYS)
    if unknown:
        raise ConfigError(f"{key}: unknown key(s) {unknown}; valid: {sorted(_ENTRY_KEYS)}")
    if ("dataset" in entry) == ("path" in entry):
        raise ConfigError(f"{key}: give exactly one of 'dataset' (a named dataset) and 'path'")
    weight = entry.get("weight", 1.0)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
    ):
        raise ConfigError(f"{key}.weight: {weight!r} is not a number")
    if weight < 0:
        raise ConfigError(f"{key}.weight: {weight} is negative; weights are shares >= 0")
    path = entry.get("path")
    dataset = entry.get("dataset", "python_docs")
    check_dataset_config(dataset, path, section=section, entry=key)
    name = entry.get("name") or (Path(path).name or path if path else dataset)
    return SourceSpec(
        name=str(name),
        dataset=dataset,
        path=path,
        weight=float(weight),
        text_field=entry.get("text_field"),
        streaming=entry.get("streaming"),
        path_key=f"{key}.path",
    )


def check_data_config(section_cfg: Any, section: str = "training") -> None:
    """The data checks that need no loading, for ``[training]`` or ``[validation]``."""
    if section_cfg.datasets:
        mixture_specs(parse_entries(section_cfg.datasets, section), section)
    else:
        check_dataset_config(section_cfg.dataset, section_cfg.dataset_path, section)


def open_source(
    spec: SourceSpec,
    *,
    tokenizer: Tokenizer,
    virtual_shards: int,
    split: str,
    section: str,
    windows: dict[str, Any],
) -> Source | TokenWindows:
    """A source ready to read: a pretokenized corpus or a small text corpus as token windows
    (``windows`` are :class:`TokenWindows`' settings), any other dataset as text. A path that
    is a URL is read from its copy in the local cache (``remote_files``)."""
    if spec.path is not None and is_url(spec.path):
        key = spec.path_key or f"{section}.dataset_path"
        local = local_copy(spec.path, key, default_cache_dir())
        spec = dataclasses.replace(spec, path=local)
    if spec.path is not None and indexed_prefixes(spec.path) is not None:
        fingerprint = getattr(tokenizer, "fingerprint", None)
        corpus = open_corpus(
            spec.path, tokenizer=fingerprint() if fingerprint else None, section=section
        )
        return TokenWindows(corpus, **windows)
    source = load_source(
        dataset=spec.dataset,
        dataset_path=spec.path,
        split=split,
        text_field=spec.text_field,
        streaming=spec.streaming,
        num_shards=virtual_shards,
        section=section,
    )
    from datasets import IterableDataset

    if holds_token_ids(source) and not isinstance(source.dataset, IterableDataset):
        return TokenWindows(
            HFTokenDocs(source.dataset, field=source.text_field, label=source.label), **windows
        )
    if _too_few_rows(source, virtual_shards):
        if holds_conversations(source):
            raise DataError(
                f"dataset '{source.label}' has {len(source.dataset)} conversations, fewer than "
                f"its {virtual_shards} virtual shards (one per sequence of the global batch); "
                f"use more conversations or a smaller {section}.global_batch_size"
            )
        return TokenWindows(_tokenize_all(source, tokenizer), **windows)
    return source


def _too_few_rows(source: Source, virtual_shards: int) -> bool:
    """A map-style dataset with fewer rows than the global batch cannot be split by rows."""
    from datasets import IterableDataset

    return not isinstance(source.dataset, IterableDataset) and len(source.dataset) < virtual_shards


def _tokenize_all(source: Source, tokenizer: Tokenizer) -> InMemoryDocs:
    """Every document of a small map-style dataset, tokenized with BOS and EOS."""
    reader = ShardReader(
        source.dataset,
        index=0,
        virtual_shards=1,
        tokenizer=tokenizer,
        text_field=source.text_field,
        label=source.label,
        window=1,
        infinite=False,
        streaming=False,
        first_on_rank=False,
    )
    docs = [
        np.asarray(tokenizer.encode(t, bos=True, eos=True), dtype=np.int64) for t in reader.texts()
    ]
    return InMemoryDocs(docs, label=source.label)


def describe(
    source: Source | TokenWindows, *, split: str, rows: int | None, shuffle: tuple[int, int] | None
) -> str:
    """What the start-up line says of one source (``shuffle``: (seed, buffer size) or None)."""
    if isinstance(source, TokenWindows):
        order = f"shuffled with seed {source.seed}" if source.shuffle else "in stored order"
        if isinstance(source.store, IndexedCorpus):
            kind = "pretokenized"
        elif isinstance(source.store, HFTokenDocs):
            kind = "token ids from the dataset"
        else:
            kind = "fewer rows than the global batch: tokenized whole, cut by tokens"
        return (
            f"{kind}, {len(source.store.doc_lengths):,} documents, {source.num_tokens:,} tokens, "
            f"{source.per_epoch:,} windows per epoch, {order}"
        )
    kind = "streamed" if rows is None else f"{rows:,} rows on this rank"
    if shuffle is None:
        order = "in stored order"
    elif rows is None:
        order = (
            f"shuffled with seed {shuffle[0]}: a shard's whole files in a new order each epoch, "
            f"documents through a buffer of {shuffle[1]}"
        )
    else:
        order = f"each epoch shuffled with seed {shuffle[0]}"
    return f"split {split}, text field '{source.text_field}', {kind}, {order}"
