"""Tokenize a training source once into a pretokenized corpus (Megatron-LM ``.bin``/``.idx``).

    python scripts/tokenize_dataset.py --job.config_file train_configs/debug_model.toml \\
        [--training.dataset_path data.jsonl --model.tokenizer_path ...] \\
        --output DIR [--workers N] [--docs-per-shard K]

The source and the tokenizer are the ones training would use: the config is parsed as train.py
parses it (any ``--section.key value`` override works), the source is ``training.dataset`` /
``training.dataset_path`` (its ``train`` split, ``training.dataset_text_field``,
``training.dataset_streaming``) and the tokenizer ``model.tokenizer_path`` or
``model.hf_assets_path``. Every row becomes one document, ``encode(text, bos=True, eos=True)``:
the tokens the on-the-fly loader packs. Training then reads the corpus with
``--training.dataset_path DIR``.

Output: ``DIR/shard_00000.bin`` + ``.idx``, ... (shard ``i`` holds rows ``[i*K, (i+1)*K)``, in
the smallest dtype the vocabulary fits, see ``token_dtype``), and ``DIR/manifest.json`` (the
tokenizer's fingerprint, the source, the dtype, the files and totals), written last.

Interrupted runs resume: a shard is complete once its marker ``shard_NNNNN.done`` is written
(after its files are renamed into place); a rerun with the same source and tokenizer keeps the
complete shards, deletes any leftovers of an unfinished one and goes on, and the result is byte
for byte what one uninterrupted run writes. A rerun into a finished DIR does nothing and says so;
a DIR holding a corpus (finished or not) of another source or tokenizer is an error.

``--workers N`` tokenizes in N processes (rows in chunks, results written in row order, so the
files are the same for any N); the main process reads rows and writes the files.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # loaded by file path: _common, and this file for worker processes
    sys.path.insert(0, _HERE)

from _common import run  # noqa: E402

DEFAULT_DOCS_PER_SHARD = 100_000
CHUNK_DOCS = 512  # rows per worker task ...
CHUNK_CHARS = 4_000_000  # ... or fewer, if they are long
STREAM_REPORT_SECONDS = 10.0
_SHARD_FILE = re.compile(r"shard_(\d{5,})\.(bin|idx|done)(\.tmp)?")


def shard_name(i: int) -> str:
    return f"shard_{i:05d}"


class Chunk:
    """Rows ``[row0, row0 + len(texts))`` of the source, all in shard ``shard``."""

    # (plain classes, not dataclasses: the benchmark and the tests load this file by path,
    # unregistered in sys.modules, where dataclass() cannot resolve its module)
    def __init__(self, shard: int, row0: int, texts: list[str]) -> None:
        self.shard, self.row0, self.texts = shard, row0, texts


class Job:
    """One run: the output folder, what identifies the corpus, and the layout."""

    def __init__(
        self,
        *,
        out: Path,
        source: dict[str, Any],
        tokenizer: dict[str, Any],
        dtype: np.dtype,
        docs_per_shard: int,
        workers: int,
    ) -> None:
        self.out = out
        self.source = source  # what identifies the source in the manifest and the markers
        self.tokenizer = tokenizer  # the tokenizer's fingerprint
        self.dtype = dtype
        self.docs_per_shard = docs_per_shard
        self.workers = workers

    def marker(self, shard: int, documents: int, tokens: int) -> dict[str, Any]:
        return {
            "shard": shard,
            "first_row": shard * self.docs_per_shard,
            "documents": documents,
            "tokens": tokens,
            "docs_per_shard": self.docs_per_shard,
            "dtype": str(self.dtype),
            "source": self.source,
            "tokenizer": self.tokenizer,
        }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, as every other error of the script
        from torchtitan.errors import ConfigError

        raise ConfigError(message.removeprefix("argument "))


def parse_cli(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the rest: the training arguments."""
    from torchtitan.errors import ConfigError

    p = _Parser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--output", help="folder the corpus is written to (created if needed)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    p.add_argument(
        "--docs-per-shard",
        type=int,
        default=DEFAULT_DOCS_PER_SHARD,
        help=f"rows per .bin/.idx shard (default {DEFAULT_DOCS_PER_SHARD:,})",
    )
    args, train_args = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if not args.output:
        raise ConfigError("--output: required: the folder to write the corpus to")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ConfigError(f"--output: '{args.output}' is a file; give a folder")
    if args.workers < 1:
        raise ConfigError(f"--workers: {args.workers} must be >= 1")
    if args.docs_per_shard < 1:
        raise ConfigError(f"--docs-per-shard: {args.docs_per_shard} must be >= 1")
    return args, train_args


def main(argv: list[str] | None = None) -> None:
    from torchtitan.config.parse import parse_args
    from torchtitan.data.indexed import token_dtype
    from torchtitan.data.tokenizer import build_tokenizer, tokenizer_source

    args, train_args = parse_cli(argv)
    jc = parse_args(train_args, need_files=False)
    source = load_text_source(jc.training)
    tok_path, tok_key = tokenizer_source(jc.model)
    tok = build_tokenizer(tok_path, key=tok_key)
    job = Job(
        out=Path(args.output).expanduser(),
        source=source_identity(jc.training, source.text_field),
        tokenizer=tok.fingerprint(),
        dtype=token_dtype(tok.n_words),
        docs_per_shard=args.docs_per_shard,
        workers=args.workers,
    )
    if finished_already(job):
        return
    if not streamed(source.dataset) and len(source.dataset) == 0:
        from torchtitan.errors import DataError

        raise DataError(f"source '{source.label}' holds no rows: there is nothing to tokenize")
    tokenize(job, source, tok)


def load_text_source(t: Any) -> Any:
    """The ``training`` section's source (``torchtitan.data.sources.Source``), checked to be
    one source of text."""
    from torchtitan.data.indexed import indexed_prefixes
    from torchtitan.data.sources import holds_token_ids, load_source
    from torchtitan.errors import ConfigError

    if t.datasets:
        raise ConfigError(
            "training.datasets: a mixture; tokenize each of its sources on its own "
            "(--training.dataset_path PATH or --training.dataset NAME) into its own --output"
        )
    if t.dataset_path is not None and indexed_prefixes(t.dataset_path) is not None:
        raise ConfigError(
            f"training.dataset_path: '{t.dataset_path}' is a pretokenized corpus already; "
            "training reads it as it is"
        )
    source = load_source(
        dataset=t.dataset,
        dataset_path=t.dataset_path,
        split="train",
        text_field=t.dataset_text_field,
        streaming=t.dataset_streaming,
        section="training",
    )
    if holds_token_ids(source):
        raise ConfigError(
            f"training.dataset_path: '{source.label}' holds token ids ('{source.text_field}') "
            "already; training reads it as it is, or set training.dataset_text_field to its text"
        )
    return source


def source_identity(t: Any, text_field: str) -> dict[str, Any]:
    """What names the source in the manifest: a local path made absolute, the split and field."""
    path = t.dataset_path
    if path is not None and Path(path).expanduser().exists():
        path = str(Path(path).expanduser().resolve())
    return {
        "dataset": None if path is not None else t.dataset,
        "dataset_path": path,
        "split": "train",
        "text_field": text_field,
    }


def finished_already(job: Job) -> bool:
    """Whether ``job.out`` holds the finished corpus of this job (said on stdout); a finished
    corpus of another source or tokenizer is an error."""
    from torchtitan.data.indexed import IndexedCorpus, indexed_prefixes, read_manifest
    from torchtitan.errors import DataError

    manifest = read_manifest(job.out) if job.out.is_dir() else None
    if manifest is None:
        return False
    if manifest.source != job.source or manifest.tokenizer != job.tokenizer:
        theirs = f"{_describe(manifest.source)} with {manifest.tokenizer.get('file')}"
        raise DataError(
            f"--output: '{job.out}' holds a finished corpus of {theirs}, not of "
            f"{_describe(job.source)} with {job.tokenizer.get('file')}; give another --output "
            "(or delete that folder)"
        )
    corpus = IndexedCorpus(indexed_prefixes(job.out) or [], label=str(job.out))
    if len(corpus) != manifest.documents or corpus.num_tokens != manifest.tokens:
        raise DataError(
            f"--output: '{job.out}': its files hold {len(corpus):,} documents and "
            f"{corpus.num_tokens:,} tokens, its manifest says {manifest.documents:,} and "
            f"{manifest.tokens:,}; delete the folder and tokenize again"
        )
    print(
        f"{job.out} holds this corpus already ({manifest.documents:,} documents, "
        f"{manifest.tokens:,} tokens, {len(manifest.files)} shards): nothing to do"
    )
    return True


def _describe(source: dict[str, Any]) -> str:
    name = source.get("dataset_path") or source.get("dataset")
    return f"'{name}' (field '{source.get('text_field')}')"


# ---- shards on disk


def kept_shards(job: Job) -> list[dict[str, Any]]:
    """The markers of the complete shards ``0..m-1`` in ``job.out``; every other shard file
    (unfinished shards, temporary files, shards after a gap) is deleted."""
    from torchtitan.errors import DataError

    job.out.mkdir(parents=True, exist_ok=True)
    kept: list[dict[str, Any]] = []
    while not kept or kept[-1]["documents"] == job.docs_per_shard:
        marker = _read_marker(job.out / f"{shard_name(len(kept))}.done")
        if marker is None:
            break
        want = job.marker(len(kept), marker.get("documents"), marker.get("tokens"))
        if marker != want:
            differs = sorted(k for k in want if marker.get(k) != want[k])
            raise DataError(
                f"--output: '{job.out}' holds an unfinished corpus written with another "
                f"{', '.join(differs)} (shard {shard_name(len(kept))}.done); rerun with the same "
                "settings, or give another --output (or delete that folder)"
            )
        if not _files_match(job.out / shard_name(len(kept)), marker):
            break
        kept.append(marker)
    for p in job.out.iterdir():
        m = _SHARD_FILE.fullmatch(p.name)
        if m and (m.group(3) or int(m.group(1)) >= len(kept)):
            p.unlink()
    (job.out / "manifest.json.tmp").unlink(missing_ok=True)
    return kept


def _read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):  # missing, or cut short
        return None
    return marker if isinstance(marker, dict) else None


def _files_match(prefix: Path, marker: dict[str, Any]) -> bool:
    from torchtitan.data.indexed import IndexedFile
    from torchtitan.errors import DataError

    try:
        f = IndexedFile(prefix)
    except DataError:
        return False
    return len(f) == marker["documents"] and int(f.doc_lengths.sum()) == marker["tokens"]


def write_marker(job: Job, shard: int, documents: int, tokens: int) -> None:
    """Mark shard ``shard`` complete (its files are in place)."""
    path = job.out / f"{shard_name(shard)}.done"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(job.marker(shard, documents, tokens), indent=2) + "\n")
    os.replace(tmp, path)


# ---- reading and tokenizing


def streamed(ds: Any) -> bool:
    from datasets import IterableDataset

    return isinstance(ds, IterableDataset)


def read_chunks(source: Any, first_row: int, docs_per_shard: int) -> Iterator[Chunk]:
    """The source's rows from ``first_row`` on, in chunks that never cross a shard boundary,
    each row checked to hold text."""
    ds, field = source.dataset, source.text_field
    columns = ds.column_names
    if columns and field not in columns:  # (a streamed source may not know its columns)
        _bad_row(source, first_row, f"has no field '{field}' (fields: {columns})")
    if not streamed(ds):  # map-style: read column slices
        ds = ds.select_columns([field])
        row, n = first_row, len(ds)
        while row < n:
            stop = min(n, row + CHUNK_DOCS, (row // docs_per_shard + 1) * docs_per_shard)
            texts = _checked(source, row, ds[row:stop][field])
            yield from _by_size(Chunk(row // docs_per_shard, row, texts))
            row = stop
        return
    rows = iter(ds.skip(first_row) if first_row else ds)
    row = first_row
    while True:
        stop = min(row + CHUNK_DOCS, (row // docs_per_shard + 1) * docs_per_shard)
        texts = [r.get(field) for r in itertools.islice(rows, stop - row)]
        if not texts:
            return
        yield from _by_size(Chunk(row // docs_per_shard, row, _checked(source, row, texts)))
        row += len(texts)


def _by_size(chunk: Chunk) -> Iterator[Chunk]:
    """``chunk`` cut into chunks of at most ``CHUNK_CHARS`` characters (or one document), which
    bounds the text in flight for corpora of long documents."""
    start, size = 0, 0
    for j, text in enumerate(chunk.texts):
        if size and size + len(text) > CHUNK_CHARS:
            yield Chunk(chunk.shard, chunk.row0 + start, chunk.texts[start:j])
            start, size = j, 0
        size += len(text)
    yield Chunk(chunk.shard, chunk.row0 + start, chunk.texts[start:] if start else chunk.texts)


def _checked(source: Any, row0: int, texts: list[Any]) -> list[str]:
    for j, text in enumerate(texts):
        if not isinstance(text, str):
            what = "no" if text is None else f"a {type(text).__name__}, not a string, as"
            _bad_row(source, row0 + j, f"has {what} field '{source.text_field}'")
    return texts


def _bad_row(source: Any, row: int, what: str) -> None:
    from torchtitan.errors import DataError

    raise DataError(
        f"source '{source.label}': row {row} {what}; set training.dataset_text_field to the "
        "field holding each row's text"
    )


def encode_texts(tok: Any, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths, tokens)`` of ``texts``: each ``encode(text, bos=True, eos=True)``, back to back."""
    docs = [tok.encode(text, bos=True, eos=True) for text in texts]
    lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    flat = itertools.chain.from_iterable(docs)
    return lengths, np.fromiter(flat, dtype=dtype, count=int(lengths.sum()))


_WORKER_STATE: tuple[Any, np.dtype] | None = None


def _init_worker(tok: Any, dtype: str) -> None:
    global _WORKER_STATE
    _WORKER_STATE = (tok, np.dtype(dtype))
    parent = multiprocessing.parent_process()
    if parent is not None:  # a killed main process (SIGKILL) must not leave its workers behind
        threading.Thread(target=_exit_with, args=(parent.sentinel,), daemon=True).start()


def _exit_with(parent_sentinel: int) -> None:
    multiprocessing.connection.wait([parent_sentinel])
    os._exit(1)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER_STATE is not None, "_init_worker sets the tokenizer"
    tok, dtype = _WORKER_STATE
    return encode_texts(tok, texts, dtype)


def _importable_self() -> Any:
    """This file as the module ``tokenize_dataset``, whose functions worker processes (started
    with "spawn", which pickles them by name) can import: the script may run as ``__main__`` or
    be loaded by file path under another name."""
    module = sys.modules.get("tokenize_dataset")
    here = os.path.abspath(__file__)
    if module is None or os.path.abspath(getattr(module, "__file__", None) or "") != here:
        sys.modules.pop("tokenize_dataset", None)
        module = importlib.import_module("tokenize_dataset")
    return module


def encoded(
    chunks: Iterator[Chunk], tok: Any, dtype: np.dtype, workers: int
) -> Iterator[tuple[Chunk, np.ndarray, np.ndarray]]:
    """``(chunk, lengths, tokens)`` for every chunk, in order (``chunk.texts`` emptied once sent
    to a worker), tokenized here or by ``workers`` processes."""
    if workers == 1:
        for chunk in chunks:
            yield chunk, *encode_texts(tok, chunk.texts, dtype)
        return
    mod = _importable_self()
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=mod._init_worker,
        initargs=(tok, dtype.str),
    )
    pending: deque[tuple[Chunk, Future]] = deque()
    try:
        for chunk in chunks:
            pending.append((chunk, pool.submit(mod._encode_in_worker, chunk.texts)))
            chunk.texts = []
            if len(pending) > 4 * workers:
                done, future = pending.popleft()
                yield done, *future.result()
        while pending:
            done, future = pending.popleft()
            yield done, *future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# ---- writing


class Report:
    """Progress on stderr: a bar over the rows when their number is known, else a plain line
    every ``STREAM_REPORT_SECONDS``; both with the tokens/s of this run."""

    def __init__(self, label: str, total: int | None, done: int) -> None:
        from torchtitan.observability.progress import Progress

        self.label, self.docs, self.new_docs, self.tokens = label, done, 0, 0
        self.t0 = time.perf_counter()
        self.next_line = self.t0 + STREAM_REPORT_SECONDS
        self.bar = Progress(f"tokenizing {label}", total) if total else None

    def rate(self) -> float:
        return self.tokens / max(time.perf_counter() - self.t0, 1e-9)

    def update(self, docs: int, tokens: int) -> None:
        self.docs += docs
        self.new_docs += docs
        self.tokens += tokens
        if self.bar is not None:
            self.bar.what = f"tokenizing {self.label} ({self.rate():,.0f} tokens/s)"
            self.bar.update(self.docs)
        elif time.perf_counter() >= self.next_line:
            self.next_line = time.perf_counter() + STREAM_REPORT_SECONDS
            print(
                f"tokenizing {self.label}: {self.docs:,} documents, {self.rate():,.0f} tokens/s",
                file=sys.stderr,
                flush=True,
            )


def tokenize(job: Job, source: Any, tok: Any) -> None:
    """Write the shards ``job.out`` lacks, then the manifest, and print the summary line."""
    from torchtitan.data.indexed import Manifest, write_manifest
    from torchtitan.errors import DataError

    created = not job.out.exists()
    markers = kept_shards(job)
    kept, first_row = len(markers), sum(m["documents"] for m in markers)
    total = None if streamed(source.dataset) else len(source.dataset)
    report = Report(source.label, total, first_row)
    if not markers or markers[-1]["documents"] == job.docs_per_shard:  # rows remain
        chunks = read_chunks(source, first_row, job.docs_per_shard)
        results = encoded(chunks, tok, job.dtype, job.workers)
        try:
            markers += write_shards(job, results, report)
        finally:
            results.close()  # stops the workers now, whatever stopped the writing
    documents, tokens = sum(m["documents"] for m in markers), sum(m["tokens"] for m in markers)
    if documents == 0:
        if created and not any(job.out.iterdir()):
            job.out.rmdir()
        raise DataError(f"source '{source.label}' holds no rows: there is nothing to tokenize")
    files = [shard_name(i) for i in range(len(markers))]
    write_manifest(
        job.out,
        Manifest(
            tokenizer=job.tokenizer,
            dtype=str(job.dtype),
            documents=documents,
            tokens=tokens,
            source=job.source,
            files=files,
            bos=True,
            eos=True,
        ),
    )
    seconds = time.perf_counter() - report.t0
    resumed = f", {kept} kept from an earlier run" if kept else ""
    print(
        f"{documents:,} documents, {tokens:,} tokens ({job.dtype}) in {len(files)} shards"
        f"{resumed}; {report.new_docs:,} documents tokenized in {seconds:.1f}s, "
        f"{report.rate():,.0f} tokens/s, {job.workers} worker{'s' if job.workers > 1 else ''} -> "
        f"{job.out}"
    )


def write_shards(
    job: Job, results: Iterator[tuple[Chunk, np.ndarray, np.ndarray]], report: Report
) -> list[dict[str, Any]]:
    """Write the tokenized chunks into their shards, each marked complete once in place; an
    unfinished shard's temporary files are removed if this stops early."""
    from torchtitan.data.indexed import IndexedWriter

    markers: list[dict[str, Any]] = []
    writer, shard = None, -1
    try:
        for chunk, lengths, tokens in results:
            if chunk.shard != shard:
                if writer is not None:
                    markers.append(_finish(job, writer, shard))
                shard = chunk.shard
                writer = IndexedWriter(job.out / shard_name(shard), job.dtype)
            writer.add_many(tokens, lengths)
            report.update(len(lengths), len(tokens))
        if writer is not None:
            markers.append(_finish(job, writer, shard))
            writer = None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return markers


def _finish(job: Job, writer: Any, shard: int) -> dict[str, Any]:
    writer.close()
    write_marker(job, shard, len(writer.lengths), writer.tokens)
    return job.marker(shard, len(writer.lengths), writer.tokens)


if __name__ == "__main__":
    run(main)
