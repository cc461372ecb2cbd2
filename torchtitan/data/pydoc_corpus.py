"""The offline debug corpus: real English prose that ships inside every Python install.

Nothing is committed or downloaded. On first use we collect two kinds of text from the running
interpreter's standard library and write them as a JSON-lines file (one ``{"text": ...}`` row per
document), which the data pipeline then loads through the same Hugging Face ``datasets`` code path
as C4:

- the language reference topics in ``pydoc_data.topics`` (what ``help("assert")`` prints), one
  document per section;
- module, class and function docstrings of the pure-Python standard library, read with ``ast`` (nothing is imported).

The file is keyed by the Python version, written atomically (temp file, then rename), so several
ranks that build it at the same moment all end up reading the same complete file.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

from torchtitan.observability.progress import Progress

CORPUS_VERSION = 1
_MIN_CHARS = 200


def default_cache_dir() -> Path:
    """``$TORCHTITAN_CACHE``, else ``$XDG_CACHE_HOME/torchtitan``, else ``~/.cache/torchtitan``."""
    if os.environ.get("TORCHTITAN_CACHE"):
        return Path(os.environ["TORCHTITAN_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "torchtitan"


def _split_sections(text: str) -> list[str]:
    # pydoc topics underline section titles with a row of '*', '=' or '-'; split before each title.
    lines = text.splitlines()
    starts = [0]
    for i in range(1, len(lines)):
        if re.fullmatch(r"[*=\-]{4,}", lines[i].strip()) and i >= 1 and lines[i - 1].strip():
            if i - 1 > starts[-1]:
                starts.append(i - 1)
    starts.append(len(lines))
    return ["\n".join(lines[a:b]).strip() for a, b in zip(starts, starts[1:])]


def _topic_documents() -> list[str]:
    from pydoc_data.topics import topics

    docs = []
    for key in sorted(topics):
        docs.extend(s for s in _split_sections(topics[key]) if len(s) >= _MIN_CHARS)
    return docs


def _stdlib_docstrings(progress: Progress | None = None) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}
    paths = [
        p
        for p in sorted(stdlib.rglob("*.py"))
        if not skip.intersection(p.relative_to(stdlib).parts)
    ]
    if progress is not None:
        progress.total = len(paths)
    docs = []
    for i, path in enumerate(paths):
        if progress is not None:
            progress.update(i + 1)
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        nodes = [tree] + [
            n
            for n in ast.walk(tree)
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc and len(doc) >= _MIN_CHARS:
                docs.append(doc.strip())
    return docs


def build_documents(progress: Progress | None = None) -> list[str]:
    """All documents of the corpus, in a fixed order for a given Python version."""
    return _topic_documents() + _stdlib_docstrings(progress)


def corpus_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of the JSON-lines corpus for this interpreter; built on first call."""
    folder = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-v{CORPUS_VERSION}"
    path = folder / "pydoc_corpus" / tag / "train.jsonl"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    # every local rank builds its own copy (then renames it into place); one shows the bar
    shown = os.environ.get("LOCAL_RANK", "0") == "0"
    bar = Progress(f"building the python_docs corpus ({path.parent})", 1) if shown else None
    with open(tmp, "w", encoding="utf-8") as f:
        for doc in build_documents(bar):
            line = json.dumps({"text": doc}, ensure_ascii=False)
            f.write(line + "\n")
    os.replace(tmp, path)
    return path
