"""Training data at a URL, copied into the local cache (torchtitan/data/remote_files.py), on
``file://`` URLs (fsspec's local filesystem, the same code that serves ``s3://``). Training from
a real S3-compatible server is in tests/e2e/test_object_storage.py."""

from __future__ import annotations

import logging
import os

import pytest

from torchtitan.data.remote_files import check_remote_data, local_copy
from torchtitan.errors import ConfigError


@pytest.fixture
def remote(tmp_path):
    folder = tmp_path / "bucket"
    (folder / "corpus").mkdir(parents=True)
    (folder / "corpus" / "part.bin").write_bytes(b"\x01\x02" * 8)
    (folder / "corpus" / "part.idx").write_bytes(b"index")
    (folder / "corpus" / ".hidden").write_text("skipped")
    (folder / "docs.jsonl").write_text('{"text": "a"}\n')
    return folder


def test_a_prefix_a_folder_and_a_file_are_copied_whole(tmp_path, remote):
    cache = tmp_path / "cache"
    prefix = local_copy((remote / "corpus" / "part").as_uri(), "k", cache)
    assert prefix.endswith("/part") and open(prefix + ".bin", "rb").read() == b"\x01\x02" * 8
    folder = local_copy((remote / "corpus").as_uri(), "k", cache)
    assert sorted(os.listdir(folder)) == [".complete", "part.bin", "part.idx"]
    file = local_copy((remote / "docs.jsonl").as_uri(), "k", cache)
    assert open(file).read() == '{"text": "a"}\n'
    assert not [p for p in (cache / "remote").iterdir() if p.name.endswith(".partial")]


def test_the_copy_is_reused_and_made_again_when_the_remote_changes(tmp_path, remote, caplog):
    url, cache = (remote / "docs.jsonl").as_uri(), tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        local_copy(url, "k", cache)
        local_copy(url, "k", cache)
    assert sum("Copying" in r.message for r in caplog.records) == 1
    (remote / "docs.jsonl").write_text('{"text": "changed, and longer"}\n')
    path = local_copy(url, "k", cache)
    assert "changed" in open(path).read()


def test_a_url_with_no_data_is_one_line_naming_the_key(tmp_path):
    url = (tmp_path / "nothing").as_uri()
    with pytest.raises(ConfigError, match=r"training.dataset_path: '.*nothing' holds no data"):
        check_remote_data(url, "training.dataset_path")
    with pytest.raises(ConfigError, match="holds no data"):
        local_copy(url, "training.dataset_path", tmp_path / "cache")


def test_a_dataset_path_url_is_checked_before_loading(tmp_path, remote):
    from torchtitan.data.sources import check_dataset_config

    check_dataset_config("python_docs", (remote / "corpus" / "part").as_uri())
    with pytest.raises(ConfigError, match="training.dataset_path: 'file://.*missing' holds no"):
        check_dataset_config("python_docs", (remote / "missing").as_uri())


def test_either_file_of_a_pair_names_the_pair_and_its_manifest_comes_along(tmp_path, remote):
    (remote / "corpus" / "manifest.json").write_text("{}")
    prefix = local_copy((remote / "corpus" / "part.idx").as_uri(), "k", tmp_path / "cache")
    folder = os.path.dirname(prefix)
    assert sorted(os.listdir(folder)) == [".complete", "manifest.json", "part.bin", "part.idx"]
