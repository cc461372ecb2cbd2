"""The file operations on a checkpoint folder, on a local disk or in object storage (a URL, see
``torchtitan.remote``), with the same guarantee: a ``step-N`` folder counts once its ``COMPLETE``
marker is there, and the marker never stands beside missing data.

On a local disk the marker is written to a temporary name, fsynced and renamed; a folder is
removed with ``rmtree`` and set aside with a rename. Object storage has no rename, but one PUT is
atomic (a multipart upload is invisible until completed), so:

- the marker is one PUT, made after every rank's data and DCP's metadata are written;
- a folder is removed marker first, so that a crash part-way leaves an unmarked folder (which
  the next start removes), never a marked one with holes;
- a folder is set aside by copying its objects, the marker last, then removing the source
  (marker first): a crash leaves two complete copies or an incomplete source.

Listings are read fresh (s3fs caches them; other ranks and runs write the same folder).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from torchtitan.remote import filesystem, is_url, join

__all__ = [
    "exists",
    "is_url",
    "join",
    "list_dirs",
    "move",
    "publish",
    "read_bytes",
    "remove",
    "upload",
    "write_atomic",
]


def _fs(url: str) -> Any:
    return filesystem(url, "checkpoint.folder")


def _make_parent(fs: Any, path: str) -> None:
    """A filesystem with folders (``file://``) needs the parent made; keys in a bucket do not."""
    if fs.root_marker:
        fs.makedirs(fs._parent(path), exist_ok=True)


def list_dirs(folder: str) -> list[str]:
    """The names of the folders directly in ``folder`` (none when it does not exist)."""
    if not is_url(folder):
        if not os.path.isdir(folder):
            return []
        return [n for n in os.listdir(folder) if os.path.isdir(os.path.join(folder, n))]
    fs = _fs(folder)
    fs.invalidate_cache()
    try:
        entries = fs.ls(folder, detail=True)
    except FileNotFoundError:
        return []
    return [e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory"]


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs = _fs(path)
    fs.invalidate_cache()
    return fs.exists(path)


def read_bytes(path: str) -> bytes | None:
    """The contents of the file ``path``; None when there is none."""
    try:
        if not is_url(path):
            with open(path, "rb") as f:
                return f.read()
        fs = _fs(path)
        fs.invalidate_cache()
        return fs.cat_file(path)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


def write_atomic(path: str, data: bytes) -> None:
    """``path`` holds ``data`` whole, or is absent (a crash part-way leaves no partial file)."""
    if is_url(path):
        fs = _fs(path)
        _make_parent(fs, path)
        fs.pipe_file(path, data)
        return
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, Ctrl-C: no temporary file left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def remove(path: str, first: str | None = None) -> bool:
    """Remove the folder ``path`` as far as it can (errors ignored: a folder left behind is
    unmarked, or is removed again later); in object storage its file ``first`` goes first, and
    when that fails nothing else is removed (the folder stays whole and marked). False when
    ``first`` could not be removed."""
    if not is_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return True
    fs = _fs(path)
    if first is not None:
        try:
            fs.rm_file(join(path, first))
        except FileNotFoundError:
            pass
        except Exception:
            return False
    try:
        fs.rm(path, recursive=True)
    except Exception:
        pass
    fs.invalidate_cache()
    return True


def move(src: str, dest: str, last: str | None = None) -> None:
    """Move the folder ``src`` to ``dest`` (which must not exist). In object storage: a copy
    with ``last`` copied last, then ``remove(src, first=last)``."""
    if not is_url(src):
        os.replace(src, dest)
        return
    fs = _fs(src)
    fs.invalidate_cache()
    root = fs._strip_protocol(src).rstrip("/")
    files = sorted(fs.find(src))
    relative = [f[len(root) + 1 :] for f in files]
    ordered = [r for r in relative if r != last] + [r for r in relative if r == last]
    for rel in ordered:
        _make_parent(fs, join(dest, rel))
        fs.copy(join(src, rel), join(dest, rel))
    if not remove(src, first=last):
        raise OSError(f"{src} was copied to {dest}, but its {last} cannot be removed")


def upload(local: str, dest: str, skip: str | None = None) -> None:
    """Copy the files of the local folder ``local`` (if it exists) into the URL ``dest``, all but
    the file ``skip``."""
    if not os.path.isdir(local):
        return
    for root, _, files in os.walk(local):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), local)
            if rel != skip:
                upload_file(os.path.join(root, name), join(dest, *rel.split(os.sep)))


def publish(tmp: str, final: str, last: str) -> None:
    """The finished local folder ``tmp`` becomes ``final``, whole or not at all: on a local disk
    by a rename (over any older ``final``); to a URL by an upload with ``last`` (the file whose
    presence means complete) uploaded last, and ``tmp`` removed."""
    if not is_url(final):
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        return
    remove(final, first=last)
    upload(tmp, final, skip=last)
    upload_file(os.path.join(tmp, last), join(final, last))
    shutil.rmtree(tmp, ignore_errors=True)


def upload_file(local: str, dest: str) -> None:
    """Copy the local file ``local`` to the URL ``dest`` (one object, whole once there)."""
    fs = _fs(dest)
    _make_parent(fs, dest)
    fs.put_file(local, dest)
