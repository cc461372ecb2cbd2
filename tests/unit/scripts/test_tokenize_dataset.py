"""scripts/tokenize_dataset.py: a source tokenized into a Megatron ``.bin``/``.idx`` corpus, read
back exactly; interrupted runs (an exception, a SIGKILL) resume to the bytes of an uninterrupted
run; any number of workers writes the same bytes; bad input is one line naming what is wrong.

Everything runs offline on small JSON-lines files with the test tokenizer."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
from offline_data import use_offline_caches
from repo_paths import DEBUG_TOML, ROOT, TOKENIZER, load_script

from torchtitan.data.indexed import open_corpus, read_manifest
from torchtitan.data.tokenizer import build_tokenizer
from torchtitan.errors import ConfigError, DataError

SCRIPT = load_script("tokenize_dataset")
TOK = build_tokenizer(TOKENIZER)


@pytest.fixture(autouse=True)
def offline_tmp_caches(tmp_path_factory, monkeypatch):
    """No Hub access, and no writes to the user's caches."""
    hf_cache = tmp_path_factory.mktemp("hf_datasets_cache")
    use_offline_caches(monkeypatch, hf_cache, tmp_path_factory.mktemp("torchtitan_cache"))


def make_texts(n: int) -> list[str]:
    """Distinct documents of varied lengths, an empty one and non-ASCII text among them."""
    words = ["alpha", "beta", "gamma", "Δelta", "épsilon", "zeta\n", "  eta", "θ", "42", "!?"]
    return [
        " ".join(words[(i + j) % len(words)] for j in range((i * 7) % 23)) + f" #{i}"
        if i % 13
        else ""
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def data(tmp_path: Path) -> tuple[Path, list[str]]:
    texts = make_texts(40)
    return write_jsonl(
        tmp_path / "data.jsonl", [{"text": t, "id": i} for i, t in enumerate(texts)]
    ), texts


def argv(source: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--job.config_file",
        DEBUG_TOML,
        "--model.tokenizer_path",
        TOKENIZER,
        "--training.dataset_path",
        str(source),
        "--output",
        str(out),
        *extra,
    ]


def tokenize(source: Path, out: Path, *extra: str) -> None:
    SCRIPT.main(argv(source, out, *extra))


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_round_trip(data, tmp_path, capsys):
    source, texts = data
    out = tmp_path / "corpus"
    tokenize(source, out, "--docs-per-shard", "7")
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and "40 documents" in summary[0] and str(out) in summary[0]

    expected = [TOK.encode(t, bos=True, eos=True) for t in texts]
    manifest = read_manifest(out)
    assert manifest.documents == 40 and manifest.tokens == sum(map(len, expected))
    assert manifest.dtype == "uint16" and manifest.bos and manifest.eos
    assert manifest.tokenizer == TOK.fingerprint()
    assert manifest.files == [f"shard_{i:05d}" for i in range(6)]  # 40 rows, 7 per shard
    assert manifest.source["dataset_path"] == str(source.resolve())
    corpus = open_corpus(out, tokenizer=TOK.fingerprint())
    assert all(f.dtype == np.uint16 for f in corpus.files)
    assert [len(f) for f in corpus.files] == [7, 7, 7, 7, 7, 5]
    assert len(corpus) == 40
    for d, want in enumerate(expected):
        assert corpus.read(d, 0, len(want)).tolist() == want
    assert corpus.doc_lengths.tolist() == [len(e) for e in expected]

    before = files_of(out)  # a rerun does nothing and says so
    tokenize(source, out, "--docs-per-shard", "7")
    assert "nothing to do" in capsys.readouterr().out
    assert files_of(out) == before


@pytest.mark.parametrize("streaming", [False, True], ids=["map_style", "streamed"])
def test_interrupted_run_resumes_to_the_same_bytes(data, tmp_path, monkeypatch, streaming):
    source, _ = data
    flags = ("--docs-per-shard", "7", "--training.dataset_streaming", str(streaming).lower())
    tokenize(source, tmp_path / "whole", *flags)

    out = tmp_path / "resumed"
    marked = []
    write_marker = SCRIPT.write_marker

    def crash_at_third_marker(job, shard, documents, tokens):
        if len(marked) == 2:  # shard 2 is closed (its .bin/.idx in place), not yet marked
            raise KeyboardInterrupt
        marked.append(shard)
        write_marker(job, shard, documents, tokens)

    monkeypatch.setattr(SCRIPT, "write_marker", crash_at_third_marker)
    with pytest.raises(KeyboardInterrupt):
        tokenize(source, out, *flags)
    monkeypatch.setattr(SCRIPT, "write_marker", write_marker)
    assert (out / "shard_00002.bin").exists() and not (out / "shard_00002.done").exists()
    assert not (out / "manifest.json").exists()
    # what a harder stop leaves: temporary files, a shard without a marker, a cut-short marker
    (out / "shard_00003.bin.tmp").write_bytes(b"\x01" * 10)
    (out / "shard_00004.bin").write_bytes(b"junk")
    (out / "shard_00004.idx").write_bytes(b"junk")
    (out / "shard_00005.done").write_text('{"shard": 5, "docu')
    (out / "manifest.json.tmp").write_text("{")

    encoded_rows = []
    encode_texts = SCRIPT.encode_texts

    def counting(tok, texts, dtype):
        encoded_rows.extend(texts)
        return encode_texts(tok, texts, dtype)

    monkeypatch.setattr(SCRIPT, "encode_texts", counting)
    tokenize(source, out, *flags)
    assert len(encoded_rows) == 40 - 2 * 7  # the two marked shards are kept, not read again
    assert files_of(out) == files_of(tmp_path / "whole")


def test_workers_write_the_same_bytes(data, tmp_path, capsys, monkeypatch):
    source, _ = data
    tokenize(source, tmp_path / "one", "--docs-per-shard", "7")
    monkeypatch.setattr(SCRIPT, "CHUNK_DOCS", 3)  # many small tasks in flight, some cut by size
    monkeypatch.setattr(SCRIPT, "CHUNK_CHARS", 40)
    tokenize(source, tmp_path / "two", "--docs-per-shard", "7", "--workers", "2")
    assert "2 workers" in capsys.readouterr().out
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


KILL_AFTER_ADDS = """
import os, signal, sys
sys.path.insert(0, {scripts!r})
import tokenize_dataset
from torchtitan.data import indexed

add_many, added = indexed.IndexedWriter.add_many, []

def add_then_die(self, tokens, lengths):
    add_many(self, tokens, lengths)
    added.append(len(lengths))
    if sum(added) > {adds}:
        self._bin.flush()
        os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    indexed.IndexedWriter.add_many = add_then_die
    tokenize_dataset.main(sys.argv[1:])
"""


def test_sigkilled_run_resumes_to_the_same_bytes(tmp_path):
    """A real kill in the middle of shard 2 (two workers), resumed with one worker."""
    texts = make_texts(300)
    source = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    flags = ("--docs-per-shard", "50")
    tokenize(source, tmp_path / "whole", *flags)
    out = tmp_path / "killed"
    wrapper = tmp_path / "kill_after_adds.py"
    wrapper.write_text(KILL_AFTER_ADDS.format(scripts=str(ROOT / "scripts"), adds=2 * 50))
    proc = subprocess.Popen(
        [sys.executable, str(wrapper), *argv(source, out, *flags, "--workers", "2")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        _, stderr = proc.communicate(timeout=60)  # EOF once its workers have exited too
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the script and any worker it left running
        raise
    assert proc.returncode == -signal.SIGKILL, stderr[-2000:]
    left = sorted(p.name for p in out.iterdir())
    assert "shard_00001.done" in left and "shard_00002.bin.tmp" in left, left
    assert "shard_00002.done" not in left and "manifest.json" not in left
    tokenize(source, out, *flags)
    assert files_of(out) == files_of(tmp_path / "whole")


# ---- bad input


def test_row_without_text_names_row_and_key(tmp_path):
    rows = [{"text": t} for t in make_texts(12)]
    rows[9] = {"body": "no text here"}
    source = write_jsonl(tmp_path / "data.jsonl", rows)
    for workers in ("1", "2"):
        out = tmp_path / f"out{workers}"
        with pytest.raises(DataError, match=r"row 9 has no field 'text'.*dataset_text_field"):
            tokenize(source, out, "--docs-per-shard", "7", "--workers", workers)
        assert list(out.iterdir()) == []  # shard 0's temporary files are cleaned up
    with pytest.raises(DataError, match=r"row 0 has no field 'body'.*training.dataset_text_field"):
        tokenize(source, tmp_path / "out2", "--training.dataset_text_field", "body")


def test_empty_source(tmp_path):
    folder = tmp_path / "empty"  # map-style (datasets cannot save a dataset made empty: filter one)
    datasets.Dataset.from_dict({"text": ["x"]}).filter(lambda row: False).save_to_disk(folder)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=rf"'{folder}' is empty: the saved dataset has no rows"):
        tokenize(folder, out)  # the source itself says so
    assert not out.exists()
    blank = tmp_path / "blank.jsonl"  # streamed: found empty at its end
    blank.write_text("\n\n")
    with pytest.raises(DataError, match=rf"source '{blank}' holds no rows"):
        tokenize(blank, out, "--training.dataset_streaming", "true")
    assert not out.exists()
    with pytest.raises(DataError, match=rf"'{blank}'"):  # not streamed: unreadable, says sources
        tokenize(blank, out)


def test_output_of_another_source_or_tokenizer_is_refused(data, tmp_path):
    source, texts = data
    other = write_jsonl(tmp_path / "other.jsonl", [{"text": t} for t in texts[:10]])
    out = tmp_path / "corpus"
    tokenize(source, out)
    before = files_of(out)
    with pytest.raises(DataError, match=rf"--output: '{out}' holds a finished corpus of"):
        tokenize(other, out)
    sp = str(ROOT / "tests" / "assets" / "tokenizer" / "sentencepiece.model")
    with pytest.raises(DataError, match=rf"--output: '{out}' holds a finished corpus"):
        tokenize(source, out, "--model.tokenizer_path", sp)
    assert files_of(out) == before

    unfinished = tmp_path / "unfinished"  # markers of another source: refused too
    tokenize(source, unfinished, "--docs-per-shard", "7")
    (unfinished / "manifest.json").unlink()
    with pytest.raises(DataError, match=rf"'{unfinished}' holds an unfinished corpus.*source"):
        tokenize(other, unfinished, "--docs-per-shard", "7")
    with pytest.raises(DataError, match="docs_per_shard"):
        tokenize(source, unfinished, "--docs-per-shard", "8")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (("--workers", "0"), "--workers: 0 must be >= 1"),
        (("--docs-per-shard", "0"), "--docs-per-shard: 0 must be >= 1"),
        (("--workers", "x"), "--workers: invalid int value: 'x'"),
    ],
)
def test_bad_options(data, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        tokenize(data[0], tmp_path / "out", *extra)


def test_errors_are_one_line_on_the_command_line(tmp_path):
    (tmp_path / "a_file").write_text("")
    for args, key in (
        (["--workers", "2"], "--output"),
        (["--output", str(tmp_path / "a_file")], "--output"),
    ):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "tokenize_dataset.py"), *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(f"error: {key}"), proc.stderr
