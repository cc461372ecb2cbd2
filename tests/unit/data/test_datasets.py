"""Tests of the Hugging Face ``datasets`` data loader: sources, packing, sharding, resume, errors.

Everything runs offline on tiny local files; the ``datasets`` cache and the debug corpus are kept in
temporary folders.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import socket
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from datasets.distributed import split_dataset_by_node
from loaders import build_loader
from offline_data import ByteTokenizer, use_offline_caches
from repo_paths import TIKTOKEN_PATH as TOKENIZER_ASSET

from torchtitan.data import sources
from torchtitan.data.batch import Batch
from torchtitan.data.sources import DATASETS
from torchtitan.data.token_windows import ShardPermutations, epoch_permutation
from torchtitan.errors import ConfigError, DataError

TOK = ByteTokenizer()


@pytest.fixture(scope="session")
def torchtitan_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("torchtitan_cache")


@pytest.fixture(autouse=True)
def offline_tmp_caches(tmp_path_factory, torchtitan_cache, monkeypatch):
    """No Hub access, and no writes to the user's caches."""
    hf_cache = tmp_path_factory.mktemp("hf_datasets_cache")
    use_offline_caches(monkeypatch, hf_cache, torchtitan_cache)


# ---- helpers


def make_docs(n: int, prefix: str = "doc") -> list[str]:
    """Distinct documents of varied lengths."""
    return [f"{prefix} {i:03d}:" + "abcdefghij"[: (i * 3) % 11] for i in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t, "id": len(t)}) + "\n")
    return path


def write_rows(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def token_stream(texts: list[str]) -> list[int]:
    out: list[int] = []
    for t in texts:
        out.extend(TOK.encode(t, bos=True, eos=True))
    return out


def build(path, **kw):
    args = dict(
        dataset="local",
        dataset_path=str(path),
        tokenizer=TOK,
        local_batch_size=2,
        seq_len=5,
    )
    args.update(kw)
    return build_loader(**args)


def take(it, n: int) -> list[Batch]:
    return [next(it) for _ in range(n)]


def windows(batches) -> list[list[int]]:
    """The seq_len + 1 token windows the batches were cut from."""
    out = []
    for inputs, labels, _ in batches:
        out.extend(torch.cat([inputs, labels[:, -1:]], dim=1).tolist())
    return out


def flat(batches) -> list[int]:
    return [t for w in windows(batches) for t in w]


def assert_same_batches(a, b) -> None:
    """The same batches, every field (inputs, labels and doc_ids) equal."""
    assert len(a) == len(b)
    for ba, bb in zip(a, b):
        assert len(ba) == len(bb) and all(torch.equal(x, y) for x, y in zip(ba, bb))


def assert_covers(batches, texts: list[str], need: int) -> None:
    """One virtual shard: the batches are the tokenized texts in order, less a short tail."""
    got, expected = flat(batches), token_stream(texts)
    assert got == expected[: len(got)]
    assert len(expected) - len(got) < need


def shard_texts(path, num_shards: int, **kw) -> list[list[str]]:
    """The documents of each virtual shard, in order (the ``split_dataset_by_node`` contract)."""
    src = sources.load_source(dataset="local", dataset_path=str(path), num_shards=num_shards, **kw)
    shards = [
        split_dataset_by_node(src.dataset, rank=v, world_size=num_shards)
        if num_shards > 1
        else src.dataset
        for v in range(num_shards)
    ]
    return [[row[src.text_field] for row in shard] for shard in shards]


def column_streams(batches) -> list[list[int]]:
    """Row ``j`` of every batch, concatenated: the token stream served from one shard."""
    n = batches[0][0].shape[0]
    cols: list[list[int]] = [[] for _ in range(n)]
    for inputs, labels, _ in batches:
        rows = torch.cat([inputs, labels[:, -1:]], dim=1).tolist()
        for j in range(n):
            cols[j].extend(rows[j])
    return cols


def assert_shards_cover(batches, shards: list[list[str]], window: int) -> None:
    """Each batch row j is shard j's tokens in order; the pass ended when a shard ran out."""
    assert len(batches[0][0]) == len(shards)
    tails = []
    for got, texts in zip(column_streams(batches), shards):
        expected = token_stream(texts)
        assert got == expected[: len(got)]
        tails.append(len(expected) - len(got))
    assert min(tails) < window


def roundtrip(state: dict) -> dict:
    """As a checkpoint would: through torch.save / torch.load."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---- packing


def test_packing_windows_labels_and_order(tmp_path):
    texts = make_docs(9)
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    batches = list(build(path, local_batch_size=3, seq_len=7, infinite=False))
    assert batches
    for inputs, labels, doc_ids in batches:
        assert inputs.shape == labels.shape == doc_ids.shape == (3, 7)
        assert inputs.dtype == labels.dtype == torch.long
        assert torch.equal(labels[:, :-1], inputs[:, 1:])
    assert all(len(w) == 8 for w in windows(batches))
    shards = shard_texts(path, 3)
    assert sorted(sum(shards, [])) == sorted(texts)  # the shards partition the documents
    assert_shards_cover(batches, shards, window=8)
    stream = flat(batches)
    assert stream[0] == TOK.bos_id and TOK.eos_id in stream


def test_infinite_stream_repeats_the_shard(tmp_path):
    texts = make_docs(5)
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    batches = take(iter(build(path, local_batch_size=2, seq_len=6)), 20)
    for got, texts in zip(column_streams(batches), shard_texts(path, 2)):
        one_pass = token_stream(texts)
        assert got == (one_pass * (len(got) // len(one_pass) + 1))[: len(got)]


# ---- sources


def _write_source(kind: str, root: Path, texts: list[str]) -> Path:
    if kind == "jsonl":
        return write_jsonl(root / "d.jsonl", texts)
    if kind == "json":
        path = root / "d.json"
        path.write_text(json.dumps([{"text": t} for t in texts]), encoding="utf-8")
        return path
    if kind == "json.gz":
        path = root / "d.jsonl.gz"
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
        return path
    if kind == "parquet":
        path = root / "d.parquet"
        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(path))
        return path
    if kind == "txt_file":
        path = root / "d.txt"
        path.write_text(texts[0], encoding="utf-8")
        return path
    if kind == "txt_folder":
        folder = root / "txt"
        folder.mkdir()
        for i, t in enumerate(texts):
            (folder / f"{i:03d}.txt").write_text(t, encoding="utf-8")
        (folder / "notes.md").write_text("ignored: not a data file")
        return folder
    if kind == "save_to_disk":
        folder = root / "saved"
        datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))}).save_to_disk(
            str(folder)
        )
        return folder
    if kind == "save_to_disk_dict":
        folder = root / "saved_dict"
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": texts})}).save_to_disk(
            str(folder)
        )
        return folder
    if kind == "jsonl_folder":
        folder = root / "shards"
        write_jsonl(folder / "part-000.jsonl", texts[:4])
        write_jsonl(folder / "part-001.jsonl", texts[4:])
        write_jsonl(folder / ".cache" / "hidden.jsonl", ["must not be read"])
        return folder
    raise AssertionError(kind)


FORMATS = [
    "jsonl",
    "json",
    "json.gz",
    "parquet",
    "txt_file",
    "txt_folder",
    "save_to_disk",
    "save_to_disk_dict",
    "jsonl_folder",
]


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
@pytest.mark.parametrize("kind", FORMATS)
def test_local_formats_load(tmp_path, kind, streaming):
    texts = make_docs(7)
    if kind in ("txt_file", "txt_folder"):
        texts = [f"Paragraph one of file {i}.\n\nParagraph two\nof file {i}.\n" for i in range(3)]
        texts = texts[:1] if kind == "txt_file" else texts
    path = _write_source(kind, tmp_path, texts)
    loader = build(path, local_batch_size=1, seq_len=3, infinite=False, streaming=streaming)
    assert loader.streaming is streaming
    batches = list(loader)
    assert_covers(batches, texts, need=4)


def test_text_field_option(tmp_path):
    texts = make_docs(6)
    path = write_jsonl(tmp_path / "d.jsonl", texts, field="content")
    batches = list(build(path, text_field="content", local_batch_size=1, infinite=False))
    assert_covers(batches, texts, need=6)


def test_named_debug_dataset(torchtitan_cache):
    loader = build_loader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=TOK,
        local_batch_size=2,
        seq_len=64,
    )
    assert not loader.streaming and loader.label == "python_docs"
    assert loader.num_rows > 1000
    it = iter(loader)
    inputs, labels, _ = next(it)
    assert inputs.shape == (2, 64) and torch.equal(labels[:, :-1], inputs[:, 1:])
    text = TOK.decode(flat([next(it) for _ in range(20)]))
    assert sum(c.isalpha() for c in text) > len(text) // 2  # English prose
    # the corpus went to the temporary cache, through the same json builder as a local file
    assert list(torchtitan_cache.rglob("train.jsonl"))


def test_registry_hub_entries_call_load_dataset(tmp_path, monkeypatch):
    local = write_jsonl(tmp_path / "d.jsonl", make_docs(4))
    calls = []

    def fake_load_dataset(path, name=None, split=None, streaming=False, **kw):
        calls.append((path, name, split, streaming))
        return datasets.load_dataset(
            "json", data_files={split: [str(local)]}, split=split, streaming=streaming
        )

    monkeypatch.setattr(sources, "load_dataset", fake_load_dataset)
    for name in ("c4", "c4_validation", "fineweb_edu"):
        loader = build_loader(
            dataset=name, dataset_path=None, tokenizer=TOK, local_batch_size=1, seq_len=4
        )
        assert loader.streaming and loader.text_field == "text"
        next(iter(loader))
    build(path="someone/corpus")
    build(path="someone/corpus", streaming=False, split="validation")
    assert calls == [
        ("allenai/c4", "en", "train", True),
        ("allenai/c4", "en", "validation", True),
        ("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True),
        ("someone/corpus", None, "train", True),
        ("someone/corpus", None, "validation", False),
    ]
    assert set(DATASETS) >= {"c4", "c4_validation", "fineweb_edu", "python_docs"}


def test_hub_id_unreachable_is_config_error():
    with pytest.raises(ConfigError) as e:
        build(path="nobody-here/no-such-dataset-xyz")
    msg = str(e.value)
    assert "training.dataset_path" in msg and "nobody-here/no-such-dataset-xyz" in msg


# ---- epochs and stopping


def test_epoch_end_is_logged(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(logging.getLogger("torchtitan"), "propagate", True)
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(3))
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        take(iter(build(path, local_batch_size=1, seq_len=4)), 30)
    lines = [r.getMessage() for r in caplog.records]
    assert f"dataset {path}: virtual shard 0 finished epoch 1, starting epoch 2" in lines
    assert f"dataset {path}: virtual shard 0 finished epoch 2, starting epoch 3" in lines


def test_non_infinite_loader_stops_and_rewinds(tmp_path):
    texts = make_docs(6)
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    loader = build(path, local_batch_size=2, seq_len=5, infinite=False)
    first = list(loader)
    assert len(first) == min(len(token_stream(t)) // 6 for t in shard_texts(path, 2))
    assert_same_batches(list(loader), first)  # the next iter() is a fresh pass


# ---- sharding


@pytest.mark.parametrize(
    "layout,streaming",
    [("file", False), ("file", True), ("two_files", True), ("two_files", False)],
)
def test_dp_ranks_see_disjoint_documents_covering_all(tmp_path, layout, streaming):
    texts = [f"doc{i:05d}" for i in range(11)]  # 8 bytes + BOS + EOS = one 10-token window each
    if layout == "file":
        path = write_jsonl(tmp_path / "d.jsonl", texts)
    else:
        write_jsonl(tmp_path / "f" / "a.jsonl", texts[:6])
        path = write_jsonl(tmp_path / "f" / "b.jsonl", texts[6:]).parent
    seen = []
    for rank in range(2):
        loader = build(
            path,
            local_batch_size=1,
            seq_len=9,
            dp_rank=rank,
            dp_world_size=2,
            streaming=streaming,
            infinite=False,
        )
        seen.append({TOK.decode(w) for w in windows(loader)})
    assert seen[0] and seen[1]
    assert not seen[0] & seen[1]
    assert seen[0] | seen[1] == set(texts)


# ---- exact resume


def _check_resume(make, k: int, m: int) -> None:
    reference = take(iter(make()), k + m)
    first = make()
    it = iter(first)
    take(it, k)
    state = roundtrip(first.state_dict())
    resumed = make()
    resumed.load_state_dict(state)
    assert_same_batches(take(iter(resumed), m), reference[k:])


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
@pytest.mark.parametrize("k", [0, 1, 3, 5, 6, 7, 9, 12])
def test_exact_resume_across_epochs(tmp_path, streaming, shuffle, k):
    # 5 documents ~ 60 tokens ~ 5 batches of 12 tokens per epoch: k..k+8 spans epoch boundaries
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(5))
    shuffled = dict(shuffle=shuffle, seed=5, shuffle_buffer=2)
    _check_resume(lambda: build(path, streaming=streaming, **shuffled), k, m=8)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_exact_resume_on_a_second_dp_rank(tmp_path, streaming):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(9))
    make = lambda: build(path, streaming=streaming, dp_rank=1, dp_world_size=2)  # noqa: E731
    for k in (2, 4, 7):
        _check_resume(make, k, m=6)


@pytest.mark.parametrize("kind", ["parquet", "txt_folder", "save_to_disk", "jsonl_folder"])
@pytest.mark.parametrize("dp_rank,dp_world_size", [(0, 1), (1, 2)])
def test_exact_resume_other_streamed_sources(tmp_path, kind, dp_rank, dp_world_size):
    path = _write_source(kind, tmp_path, make_docs(8))
    make = lambda: build(  # noqa: E731
        path, streaming=True, dp_rank=dp_rank, dp_world_size=dp_world_size, seq_len=3
    )
    for k in (1, 4, 9):
        _check_resume(make, k, m=6)


def test_resume_with_long_document_leftover(tmp_path):
    """A document longer than several batches: the leftover buffer carries the rest."""
    texts = ["short one", "L" * 200, "after the long one"]
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    for streaming in (False, True):
        _check_resume(lambda s=streaming: build(path, streaming=s, seq_len=7), 3, m=10)


def test_new_iter_continues_where_the_last_stopped(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(5))
    for streaming in (False, True):
        reference = take(iter(build(path, streaming=streaming)), 12)
        loader = build(path, streaming=streaming)
        got = take(iter(loader), 4) + take(iter(loader), 8)
        assert_same_batches(got, reference)


def test_state_dict_format_is_small_and_keyed_by_rank(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(50))
    loader = build(path, streaming=True, dp_rank=1, dp_world_size=2)
    take(iter(loader), 3)
    state = loader.state_dict()
    # local batch 2 x dp 2: 4 virtual shards, this rank owns shards 2 and 3
    assert set(state) == {"virtual_shards", "shard_2", "shard_3"} and state["virtual_shards"] == 4
    for key in ("shard_2", "shard_3"):
        blob = state[key]
        assert isinstance(blob, bytes) and len(blob) < 2000
        inner = json.loads(blob)
        assert inner["epoch"] == 0 and inner["row"] > 0 and inner["hf_state"]
        assert inner["windows"] == 3
        assert len(inner["buffer"]) < 6 + 30  # leftover: less than a window plus a document
        assert "doc 049" not in blob.decode()


# ---- errors


def test_unknown_dataset_name():
    with pytest.raises(ConfigError) as e:
        build_loader(dataset="c5", dataset_path=None, tokenizer=TOK, local_batch_size=1, seq_len=4)
    msg = str(e.value)
    assert "training.dataset" in msg and "'c5'" in msg
    assert all(name in msg for name in ("c4", "c4_validation", "fineweb_edu", "python_docs"))


@pytest.mark.parametrize(
    "path", ["./missing.jsonl", "/no/such/dir", "data/train.jsonl", "just_a_name"]
)
def test_missing_local_path(path):
    with pytest.raises(ConfigError) as e:
        build(path=path)
    msg = str(e.value)
    assert "training.dataset_path" in msg and path in msg and "parquet" in msg


def test_folder_without_usable_files(tmp_path):
    (tmp_path / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "README.md").write_text("hello")
    with pytest.raises(ConfigError) as e:
        build(tmp_path)
    msg = str(e.value)
    assert "training.dataset_path" in msg and str(tmp_path) in msg and "jsonl" in msg


def test_folder_with_mixed_kinds(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"])
    (tmp_path / "b.txt").write_text("y")
    with pytest.raises(ConfigError, match="mixes"):
        build(tmp_path)


def test_unsupported_file(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(ConfigError, match=r"training\.dataset_path.*data\.csv"):
        build(path)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_row_without_text_field(tmp_path, streaming):
    rows = [{"text": t} for t in make_docs(3)] + [{"body": "no text here", "id": 3}]
    path = write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        list(build(path, streaming=streaming, infinite=False, local_batch_size=1))
    msg = str(e.value)
    assert str(path) in msg and "row 3" in msg and "'text'" in msg
    assert "['body', 'id']" in msg and "training.dataset_text_field" in msg


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_no_row_has_the_text_field(tmp_path, streaming):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(3), field="content")
    with pytest.raises(DataError) as e:
        next(iter(build(path, streaming=streaming)))
    msg = str(e.value)
    assert "row 0" in msg and "'text'" in msg and "content" in msg


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_non_string_text_value(tmp_path, streaming):
    rows = [{"text": "fine"}, {"text": "also fine"}, {"text": 5}, {"text": "never read"}]
    path = write_rows(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        list(build(path, streaming=streaming, infinite=False, local_batch_size=1))
    msg = str(e.value)
    assert "row 2" in msg and "'text'" in msg and "int" in msg and "not a string" in msg


def test_bad_row_index_is_within_the_rank_shard(tmp_path):
    rows = [{"text": f"doc {i}"} for i in range(10)]
    rows[7] = {"title": "no text"}
    path = write_rows(tmp_path / "d.jsonl", rows)
    # 4 virtual shards of rows 0-2, 3-5, 6-7, 8-9; dp rank 1 owns shards 2 and 3
    list(build(path, dp_rank=0, dp_world_size=2, infinite=False))
    with pytest.raises(DataError, match=r"row 1 of virtual shard 2 \(of 4\)"):
        list(build(path, dp_rank=1, dp_world_size=2, infinite=False))


def test_state_from_another_global_batch_size(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(8))
    saved = build(path, dp_rank=0, dp_world_size=2)
    take(iter(saved), 1)
    state = saved.state_dict()
    with pytest.raises(ConfigError) as e:
        build(path).load_state_dict(state)
    msg = str(e.value)
    assert "saved with 4 virtual shards" in msg and "this run has 2" in msg
    assert "training.global_batch_size = 4" in msg
    with pytest.raises(ConfigError, match=r"no state for virtual shard\(s\) \[2, 3\]"):
        build(path, dp_rank=1, dp_world_size=2).load_state_dict(state)


def test_state_from_other_streaming_mode(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(8))
    saved = build(path, streaming=True)
    take(iter(saved), 1)
    with pytest.raises(ConfigError, match="training.dataset_streaming"):
        build(path, streaming=False).load_state_dict(saved.state_dict())


# ---- the real tokenizer


@pytest.mark.skipif(
    not TOKENIZER_ASSET.exists(), reason=f"test tokenizer asset {TOKENIZER_ASSET} not present yet"
)
def test_real_tokenizer_on_the_debug_corpus():
    tokenizer_mod = pytest.importorskip("torchtitan.data.tokenizer")
    tokenizer = tokenizer_mod.build_tokenizer(str(TOKENIZER_ASSET))
    loader = build_loader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=tokenizer,
        local_batch_size=2,
        seq_len=32,
    )
    it = iter(loader)
    batches = take(it, 4)
    for inputs, labels, _ in batches:
        assert inputs.shape == (2, 32) and torch.equal(labels[:, :-1], inputs[:, 1:])
        assert int(inputs.max()) < tokenizer.n_words and int(inputs.min()) >= 0
    stream = flat(batches)
    assert stream[0] == tokenizer.bos_id
    assert any(c.isalpha() for c in tokenizer.decode(stream))
    state = roundtrip(loader.state_dict())
    resumed = build_loader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=tokenizer,
        local_batch_size=2,
        seq_len=32,
    )
    resumed.load_state_dict(state)
    assert_same_batches(take(iter(resumed), 2), take(it, 2))


# ---- the global batch is a function of (dataset, step), not of the layout

# (dp world size, local batch size) for a global batch of 8 sequences: 1 to 8 accumulation steps
LAYOUTS = [(1, 8), (1, 2), (2, 2), (4, 2), (4, 1), (8, 1)]


def global_batches(make, dp: int, local: int, steps: int, start: list[dict] | None = None):
    """Each step's global batch as the data-parallel ranks read it, stacked in rank order."""
    loaders = [make(dp_rank=r, dp_world_size=dp, local_batch_size=local) for r in range(dp)]
    if start is not None:
        merged = {k: v for state in start for k, v in state.items()}
        for loader in loaders:
            loader.load_state_dict(roundtrip(merged))
    its = [iter(loader) for loader in loaders]
    accum = 8 // (dp * local)
    out = []
    for _ in range(steps):
        per_rank = [torch.cat([next(it)[0] for _ in range(accum)]) for it in its]
        out.append(torch.cat(per_rank))
    return out, loaders


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_global_batch_is_the_same_for_every_layout(tmp_path, streaming, shuffle):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(40))
    shuffled = dict(shuffle=shuffle, seed=5, shuffle_buffer=2)

    def make(**kw):
        return build(path, streaming=streaming, global_batch_size=8, seq_len=7, **shuffled, **kw)

    reference, _ = global_batches(make, 1, 8, steps=6)
    assert all(b.shape == (8, 7) for b in reference)
    assert len({tuple(b.flatten().tolist()) for b in reference}) == 6  # steps differ
    for dp, local in LAYOUTS[1:]:
        got, _ = global_batches(make, dp, local, steps=6)
        for step, (a, b) in enumerate(zip(reference, got), 1):
            assert torch.equal(a, b), f"dp={dp} local={local}: step {step} differs"


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_resume_with_another_data_parallel_degree(tmp_path, streaming, shuffle):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(40))
    shuffled = dict(shuffle=shuffle, seed=5, shuffle_buffer=2)

    def make(**kw):
        return build(path, streaming=streaming, global_batch_size=8, seq_len=7, **shuffled, **kw)

    reference, _ = global_batches(make, 1, 8, steps=7)
    _, saved = global_batches(make, 2, 2, steps=3)
    states = [loader.state_dict() for loader in saved]
    for dp, local in ((4, 2), (1, 2), (8, 1)):
        got, _ = global_batches(make, dp, local, steps=4, start=states)
        for a, b in zip(reference[3:], got):
            assert torch.equal(a, b), f"resumed on dp={dp} local={local}"


def test_global_batch_must_split_over_ranks(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(8))
    with pytest.raises(ConfigError, match=r"training.global_batch_size: 6 must be a multiple.*4"):
        build(path, dp_world_size=2, local_batch_size=2, global_batch_size=6)


def test_fewer_rows_than_the_global_batch_are_cut_by_tokens(tmp_path):
    """3 documents, 8 sequences per step: the corpus is tokenized whole and cut into windows,
    window k of the stream going to row k % 8 of step k // 8, epoch after epoch."""
    texts = make_docs(3)
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    stream = token_stream(texts)
    per_epoch = len(stream) // 6
    got = windows(take(iter(build(path, local_batch_size=8)), 3))
    expected = [stream[(k % per_epoch) * 6 : (k % per_epoch + 1) * 6] for k in range(24)]
    assert got == expected
    # Shuffled: every epoch is a permutation of the 3 documents; layouts agree.
    one = windows(take(iter(build(path, local_batch_size=8, shuffle=True, seed=1)), 3))
    two = [
        build(
            path,
            local_batch_size=4,
            dp_rank=r,
            dp_world_size=2,
            global_batch_size=8,
            shuffle=True,
            seed=1,
        )
        for r in range(2)
    ]
    its = [iter(ld) for ld in two]
    assert one == [w for _ in range(3) for it in its for w in windows([next(it)])]
    assert one != got


def test_an_empty_dataset_is_one_line(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl' is empty: its data files hold no bytes"):
        build(path)
    path.write_text("\n\n")  # blank lines, no rows
    with pytest.raises(DataError, match=r"training.dataset_path: .* cannot read .*empty\.jsonl"):
        build(path)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_empty_parquet_and_saved_datasets_are_one_line(tmp_path, streaming):
    datasets.Dataset.from_dict({"text": []}).to_parquet(str(tmp_path / "e.parquet"))
    # map-style: loading says so; streamed: the first read finds no rows
    with pytest.raises(DataError, match=r"cannot read .*e\.parquet|e\.parquet.* has no rows"):
        next(iter(build(tmp_path / "e.parquet", streaming=streaming)))
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "saved"))
    with pytest.raises(DataError, match=r"cannot load saved dataset .*saved.*is it empty"):
        build(tmp_path / "saved", streaming=streaming)


def test_streamed_data_with_fewer_rows_than_shards(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(3))
    with pytest.raises(DataError, match=r"virtual shard 3 \(of 4\) has no rows.*global_batch_size"):
        next(iter(build(path, local_batch_size=4, streaming=True)))


# ---- data errors: named as precisely as config errors, found while the data is built


def _jsonl_with(path: Path, bad: bytes, at: int = 301, rows: int = 310) -> Path:
    """JSON lines whose line ``at`` (1-based) is ``bad``."""
    lines = [json.dumps({"text": f"doc {i} " * 5}).encode() for i in range(rows)]
    lines[at - 1] = bad
    with (gzip.open if path.name.endswith(".gz") else open)(path, "wb") as f:
        f.write(b"\n".join(lines) + b"\n")
    return path


BAD_LINES = [
    (
        "d.jsonl",
        b'{"text": "cut short',
        "not valid JSON: Unterminated string starting at column 10",
    ),
    ("d.jsonl.gz", b'{"text": "a", "id": }', "not valid JSON: Expecting value at column 21"),
    ("d.jsonl", b"[1, 2]", "a JSON list, not an object"),
    ("d.jsonl", b'{"text": "a"} x', "not valid JSON: Extra data at column 15"),
]


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
@pytest.mark.parametrize("name, bad, why", BAD_LINES, ids=["cut", "gz", "list", "extra"])
def test_a_malformed_json_line_is_named_by_file_and_line(tmp_path, name, bad, why, streaming):
    path = _jsonl_with(tmp_path / name, bad)
    with pytest.raises(DataError) as e:
        build(path, streaming=streaming)
    assert str(e.value) == (
        f"training.dataset_path: '{path}' line 301 is {why}; fix or remove that line"
    )


def test_a_malformed_json_document_is_named_by_line(tmp_path):
    rows = [json.dumps({"text": f"doc {i}"}) + "," for i in range(40)]
    rows[29] = '{"text": "doc 29" "id": 3},'
    path = tmp_path / "d.json"
    path.write_text("\n".join(["[", *rows, '{"text": "last"}', "]"]) + "\n")
    with pytest.raises(DataError) as e:
        build(path)
    assert str(e.value) == (
        f"training.dataset_path: '{path}' line 31 is not valid JSON: Expecting ',' delimiter at "
        "column 19; fix or remove that line"
    )


def test_a_bad_line_met_part_way_through_a_stream_is_named(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", make_docs(20))
    _jsonl_with(folder / "b.jsonl", b"{oops}", at=5, rows=8)
    loader = build(folder, streaming=True, local_batch_size=1, infinite=False)  # a.jsonl reads
    with pytest.raises(DataError) as e:
        list(loader)
    assert str(e.value) == (
        f"training.dataset_path: '{folder / 'b.jsonl'}' line 5 is not valid JSON: Expecting "
        "property name enclosed in double quotes at column 2; fix or remove that line"
    )


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_a_wrong_text_field_or_type_stops_while_the_data_is_built(tmp_path, streaming, shuffle):
    """The loader is not returned (train.py builds the model after it): the line reading the
    first row gives."""
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(6), field="content")
    with pytest.raises(DataError) as e:
        build(path, streaming=streaming, shuffle=shuffle)
    assert str(e.value) == (
        f"dataset '{path}': row 0 of virtual shard 0 (of 2) has no field 'text' (missing or "
        "null); the row has fields ['content', 'id']; set training.dataset_text_field to the "
        "field that holds the text"
    )
    path = write_rows(tmp_path / "n.jsonl", [{"text": 5 + i, "id": i} for i in range(6)])
    with pytest.raises(DataError) as e:
        build(path, streaming=streaming, shuffle=shuffle)
    first = e.value.args[0].split(" holds int ")[1].split(",")[0]
    assert str(e.value) == (
        f"dataset '{path}': row 0 of virtual shard 0 (of 2) field 'text' holds int {first}, not "
        "a string, a list of integer token ids or a conversation (a list of messages); the row "
        "has fields ['id', 'text']; set "
        "training.dataset_text_field to the field that holds the text"
    )
    assert first == "5" or shuffle  # shuffled: the first row of the epoch's permutation


def test_an_empty_stream_stops_while_the_data_is_built(tmp_path):
    datasets.Dataset.from_dict({"text": []}).to_parquet(str(tmp_path / "e.parquet"))
    with pytest.raises(DataError) as e:
        build(tmp_path / "e.parquet", streaming=True)
    assert str(e.value) == (
        f"dataset '{tmp_path / 'e.parquet'}': virtual shard 0 (of 2) has no rows; use a larger "
        "dataset or a smaller training.global_batch_size (one virtual shard per sequence of the "
        "global batch)"
    )


@pytest.fixture()
def closed_port():
    """A local port bound but never listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


# timed: alone, at the normal CPU priority (tests/helpers/lanes.py)
@pytest.mark.exclusive
@pytest.mark.parametrize("offline", [False, True], ids=["unreachable", "HF_HUB_OFFLINE"])
def test_an_unusable_hub_fails_in_seconds_in_one_line(monkeypatch, closed_port, offline):
    """The default validation set with no network: one line naming the key and a local
    alternative, in seconds, not after a minute of retries."""
    import huggingface_hub.constants

    endpoint = f"http://127.0.0.1:{closed_port}"
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
    if not offline:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        build_loader(
            dataset="c4_validation",
            dataset_path=None,
            tokenizer=TOK,
            local_batch_size=1,
            seq_len=4,
            split="validation",
            section="validation",
            infinite=False,
        )
    assert time.monotonic() - start < 10
    why = "HF_HUB_OFFLINE is set" if offline else f"no answer from {endpoint}: Connection refused"
    assert str(e.value) == (
        "validation.dataset: 'c4_validation' is allenai/c4 (config en, split validation) on the "
        f"Hugging Face Hub, which cannot be used here ({why}) and is not in the datasets cache; "
        "set validation.dataset_path to a local copy (a .jsonl, .parquet or .txt file, or a "
        "folder of them), or validation.dataset = 'python_docs'"
    )
    assert huggingface_hub.constants.HF_HUB_OFFLINE is offline  # offline mode was put back


# timed: alone, at the normal CPU priority (tests/helpers/lanes.py)
@pytest.mark.exclusive
def test_a_hub_that_never_answers_counts_as_unreachable(monkeypatch):
    import huggingface_hub.constants

    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        start = time.monotonic()
        assert sources.hub_unreachable(timeout=0.5) == f"no answer from {endpoint}: timed out"
        assert time.monotonic() - start < 2


# ---- shuffling


def test_shard_permutation_slices_are_the_contiguous_shards_of_datasets():
    for n, shards in ((10, 3), (8, 8), (17, 4), (5, 1)):
        ds = datasets.Dataset.from_dict({"i": list(range(n))})
        perms = ShardPermutations(n, seed=0, shards=shards)
        for v in range(shards):
            start, stop = perms.bounds(v)
            assert split_dataset_by_node(ds, rank=v, world_size=shards)["i"] == list(
                range(start, stop)
            )
        epoch = np.concatenate([perms.rows(3, v) for v in range(shards)])
        assert sorted(epoch.tolist()) == list(range(n))


def test_shuffled_map_style_epochs_are_seeded_permutations(tmp_path):
    texts = make_docs(12)
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    ld = build(path, local_batch_size=1, seq_len=3, shuffle=True, seed=9)
    epoch_tokens = len(token_stream(texts))
    got = flat(take(iter(ld), 3 * epoch_tokens // 4))  # about three epochs
    for epoch in range(2):
        order = epoch_permutation(12, 9, epoch)
        expected = token_stream([texts[i] for i in order])
        start = epoch * epoch_tokens
        assert got[start : start + epoch_tokens] == expected, epoch
    assert epoch_permutation(12, 9, 0).tolist() != epoch_permutation(12, 9, 1).tolist()
    again = flat(take(iter(build(path, local_batch_size=1, seq_len=3, shuffle=True, seed=9)), 20))
    other = flat(take(iter(build(path, local_batch_size=1, seq_len=3, shuffle=True, seed=8)), 20))
    assert again == got[: len(again)] and other != again


def test_shuffled_stream_reads_every_document_once_per_epoch(tmp_path):
    texts = make_docs(30)
    path = write_jsonl(tmp_path / "d.jsonl", texts)

    def first_epoch() -> list[str]:
        ld = build(
            path,
            streaming=True,
            local_batch_size=1,
            seq_len=3,
            shuffle=True,
            seed=2,
            shuffle_buffer=8,
        )
        got = flat(take(iter(ld), len(token_stream(texts)) // 4))
        docs, cur = [], []
        for t in got:  # cut the stream at EOS: whole documents in the order they were read
            cur.append(t)
            if t == TOK.eos_id:
                docs.append(TOK.decode(cur))
                cur = []
        return docs

    docs = first_epoch()
    assert len(docs) >= 29 and len(set(docs)) == len(docs) and set(docs) <= set(texts)
    assert docs != texts[: len(docs)]  # shuffled
    assert first_epoch() == docs  # the same seed gives the same order


def _files(folder: Path, n_files: int, rows: int) -> Path:
    folder.mkdir()
    for f in range(n_files):
        write_jsonl(
            folder / f"part{f}.jsonl", [f"file {f} row {r} " + "x" * (r % 4) for r in range(rows)]
        )
    return folder


@pytest.mark.parametrize("k", [0, 4, 9, 15])
def test_streamed_files_are_reshuffled_every_epoch_and_resume_exactly(tmp_path, k):
    """4 files, 2 virtual shards: each shard reads its 2 whole files in a new order each epoch."""
    folder = _files(tmp_path / "d", 4, 3)

    def make():
        return build(
            folder,
            streaming=True,
            local_batch_size=2,
            seq_len=7,
            shuffle=True,
            seed=1,
            shuffle_buffer=0,
        )

    _check_resume(make, k, m=8)
    shard0 = column_streams(take(iter(make()), 40))[0]  # shard 0 holds files 0 and 2
    docs, cur = [], []
    for t in shard0:
        cur.append(t)
        if t == TOK.eos_id:
            docs.append(TOK.decode(cur))
            cur = []
    firsts = [int(d.split()[1]) for d in docs if d.split()[2:4] == ["row", "0"]]
    epochs = [tuple(firsts[i : i + 2]) for i in range(0, 6, 2)]
    assert all(sorted(e) == [0, 2] for e in epochs) and len(set(epochs)) == 2, epochs


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_resume_inside_a_step(tmp_path, streaming, shuffle):
    """Saved between the two accumulation microbatches of a step, resumed on the same layout."""
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(40))

    def make():
        return build(
            path,
            streaming=streaming,
            local_batch_size=2,
            global_batch_size=4,
            shuffle=shuffle,
            seed=3,
            shuffle_buffer=2,
        )

    reference = take(iter(make()), 9)
    first = make()
    take(iter(first), 5)  # two steps and one microbatch of the third
    resumed = make()
    resumed.load_state_dict(roundtrip(first.state_dict()))
    assert_same_batches(take(iter(resumed), 4), reference[5:])


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_every_pass_of_a_shuffled_validation_loader_is_the_same(tmp_path, streaming):
    path = write_jsonl(tmp_path / "d.jsonl", make_docs(9))
    ld = build(
        path,
        streaming=streaming,
        local_batch_size=1,
        infinite=False,
        shuffle=True,
        seed=3,
        shuffle_buffer=3,
    )
    passes = [[x for x, *_ in ld] for _ in range(3)]
    assert len(passes[0]) > 3
    for other in passes[1:]:
        assert_same_batches([(x, x) for x in other], [(x, x) for x in passes[0]])
