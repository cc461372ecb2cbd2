"""scripts/download_tokenizer.py run as a user runs it, offline: one line on stderr; and
scripts/build_test_tokenizers.py's full build (the pydoc corpus and two BPE trainings, ~10 s)
reproducing the committed test tokenizers. The tokenizers and the scripts' other checks are in
tests/unit/data/test_tokenizer.py."""

from __future__ import annotations

import hashlib

import pytest
from download_scripts import check_offline_download_is_one_line
from repo_paths import TOKENIZER_ASSETS, load_script

REPO = "meta-llama/Meta-Llama-3.1-8B"


def test_download_offline_subprocess(tmp_path):
    check_offline_download_is_one_line("download_tokenizer.py", REPO, tmp_path)


@pytest.fixture(scope="module")
def build_script():
    return load_script("build_test_tokenizers")


@pytest.fixture(scope="module")
def fresh_build(build_script):
    """(documents, freshly trained assets, whether the corpus is the one of the committed assets)"""
    docs = build_script.corpus_documents()
    same_corpus = build_script.corpus_fingerprint(docs) == build_script.CORPUS_SHA256
    return docs, build_script.build_assets(docs), same_corpus


def test_build_script_reproduces_assets(build_script, fresh_build):
    docs, assets, same_corpus = fresh_build
    if not same_corpus:
        # Another Python gives another corpus: check only that training is deterministic.
        assert build_script.build_assets(docs) == assets
        pytest.skip(
            f"corpus differs from the assets' (Python {build_script.CORPUS_PYTHON}); "
            "checked determinism only"
        )
    for name, data in assets.items():
        committed = (TOKENIZER_ASSETS / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == hashlib.sha256(committed).hexdigest(), name


def test_build_script_check_mode(build_script, fresh_build, monkeypatch, tmp_path, capsys):
    docs, assets, same_corpus = fresh_build
    monkeypatch.setattr(build_script, "corpus_documents", lambda: docs)
    monkeypatch.setattr(build_script, "build_assets", lambda docs: assets)
    for name, data in assets.items():
        (tmp_path / name).write_bytes(data)
    assert build_script.main(["--check", "--out_dir", str(tmp_path)]) == 0
    (tmp_path / "tiktoken.model").write_bytes(b"stale")
    assert build_script.main(["--check", "--out_dir", str(tmp_path)]) == 1
    assert "tiktoken.model: differs from a fresh build" in capsys.readouterr().err
    if same_corpus:
        assert build_script.main(["--check"]) == 0
