"""Training data at a URL (``s3://bucket/corpus``, any installed fsspec protocol): a pretokenized
corpus (a ``.bin``/``.idx`` prefix or a folder of them) or data files (json, jsonl, parquet,
txt, a saved dataset), copied once per machine into the local cache and read from there like a
local path.

A corpus is memory-mapped, so it must be on a local disk; the copy is made by the first rank of a
machine to get there (a file lock), the others wait and reuse it. The copy is keyed by the URL
and checked against the remote listing (names, sizes and ETags) on every start: a changed remote
corpus is copied again, never read stale. It lives in ``$TORCHTITAN_CACHE/remote/`` (see
``default_cache_dir``) and appears whole or not at all (written beside, then renamed).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan.data.indexed import MANIFEST
from torchtitan.errors import ConfigError
from torchtitan.observability.log import logger
from torchtitan.remote import check_reachable, filesystem, is_url

__all__ = ["check_remote_data", "is_url", "local_copy"]

_INDEXED = (".bin", ".idx")
_DONE = ".complete"  # in a finished copy: the listing it was made from


def _listing(fs: Any, url: str) -> tuple[str, list[dict[str, Any]]]:
    """What ``url`` names: ``("file", [entry])``, ``("folder", entries)``, ``("prefix",
    entries)`` (an indexed corpus ``url.bin`` / ``url.idx``), or ``("", [])`` for nothing.
    Each entry: ``rel`` (its path under the copy), ``size``, ``etag``."""
    fs.invalidate_cache()
    root = fs._strip_protocol(url).rstrip("/")

    def entry(info: dict[str, Any], rel: str) -> dict[str, Any]:
        tag = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("md5Hash")
        return {"rel": rel, "size": int(info.get("size") or 0), "etag": str(tag or "")}

    if fs.isdir(url):
        found = fs.find(url, detail=True)
        entries = [
            entry(info, name[len(root) + 1 :])
            for name, info in sorted(found.items())
            if not any(p.startswith(".") for p in name[len(root) + 1 :].split("/"))
        ]
        return "folder", entries
    if root.endswith(_INDEXED):  # either file of a pair names the pair, as a local path does
        root = root[:-4]
    elif fs.isfile(url):
        return "file", [entry(fs.info(url), root.rsplit("/", 1)[-1])]
    parts = [root + ext for ext in _INDEXED if fs.isfile(root + ext)]
    folder = root.rsplit("/", 1)[0]
    if parts and fs.isfile(f"{folder}/{MANIFEST}"):  # the corpus's tokenizer, checked on open
        parts.append(f"{folder}/{MANIFEST}")
    return ("prefix" if parts else ""), [entry(fs.info(p), p.rsplit("/", 1)[-1]) for p in parts]


def check_remote_data(url: str, key: str) -> None:
    """Preflight: the storage answers and ``url`` names data (ConfigError naming ``key``)."""
    check_reachable(url, key)
    fs = filesystem(url, key)
    kind, entries = _listing(fs, url)
    if not entries:
        raise ConfigError(
            f"{key}: '{url}' holds no data: no such file, no folder of files and no "
            f"{url.rstrip('/')}.bin/.idx corpus"
        )


def local_copy(url: str, key: str, cache: Path) -> str:
    """The local path to read for ``url`` (a file, a folder, or a corpus prefix), copied into
    ``cache/remote/`` if it is not there already, or changed since."""
    fs = filesystem(url, key)
    name = hashlib.sha256(url.encode()).hexdigest()[:16]
    dest = cache / "remote" / name
    with _lock(cache / "remote" / f"{name}.lock"):  # listed under the lock: one version per copy
        kind, entries = _listing(fs, url)
        if not entries:
            check_remote_data(url, key)  # raises the line that says why
        signature = json.dumps({"url": url, "files": entries}, sort_keys=True)
        done = dest / _DONE
        if not (done.is_file() and done.read_text() == signature):
            _copy(fs, url, kind, entries, dest, signature)
    if kind == "folder":
        return str(dest)
    if kind == "prefix":
        return str(dest / entries[0]["rel"].rsplit(".", 1)[0])
    return str(dest / entries[0]["rel"])


def _copy(
    fs: Any, url: str, kind: str, entries: list[dict[str, Any]], dest: Path, signature: str
) -> None:
    size = sum(e["size"] for e in entries)
    logger.info(
        f"Copying {url} ({len(entries)} file{'s' * (len(entries) != 1)}, {size / 2**20:,.1f} MiB) "
        f"to the local cache {dest}"
    )
    t0 = time.perf_counter()
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    root = fs._strip_protocol(url).rstrip("/")
    base = root if kind == "folder" else root.rsplit("/", 1)[0]
    for e in entries:
        local = tmp / e["rel"]
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(f"{base}/{e['rel']}", str(local))
    (tmp / _DONE).write_text(signature)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    logger.info(f"Copied {url} in {time.perf_counter() - t0:.2f}s")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """One process of this machine at a time (the others wait for its copy)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
