"""Pretokenized corpora: Megatron-LM's ``.bin``/``.idx`` format, the token-window stream, and the
loader reading it (shuffling, data-parallel invariance, exact resume, bad input)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from loaders import build_loader

from torchtitan.data.indexed import (
    IndexedCorpus,
    IndexedFile,
    IndexedWriter,
    Manifest,
    indexed_prefixes,
    token_dtype,
    write_manifest,
)
from torchtitan.data.token_windows import InMemoryDocs, TokenWindows
from torchtitan.errors import ConfigError, DataError

VOCAB = 300
RNG = np.random.default_rng(0)


def random_docs(n: int, lo: int = 1, hi: int = 40, vocab: int = VOCAB) -> list[np.ndarray]:
    return [RNG.integers(0, vocab, RNG.integers(lo, hi)).astype(np.int64) for _ in range(n)]


def write_corpus(prefix: Path, docs: list[np.ndarray], dtype=np.uint16) -> str:
    w = IndexedWriter(prefix, np.dtype(dtype))
    for d in docs:
        w.add(d)
    w.close()
    return str(prefix)


def read_by_the_published_format(prefix: str) -> list[np.ndarray]:
    """An independent reader of the format as Megatron-LM documents it (header, counts, int32
    lengths, int64 byte pointers, int64 document indices), by ``struct`` and plain file reads."""
    codes = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        (version,) = struct.unpack("<Q", f.read(8))
        (code,) = struct.unpack("<B", f.read(1))
        n_seq, n_doc = struct.unpack("<QQ", f.read(16))
        lengths = struct.unpack(f"<{n_seq}i", f.read(4 * n_seq))
        pointers = struct.unpack(f"<{n_seq}q", f.read(8 * n_seq))
        doc_idx = struct.unpack(f"<{n_doc}q", f.read(8 * n_doc))
        assert f.read() == b""
    assert version == 1
    data = Path(prefix + ".bin").read_bytes()
    dt = np.dtype(codes[code])
    seqs = [np.frombuffer(data, dt, n, p) for n, p in zip(lengths, pointers, strict=True)]
    return [np.concatenate(seqs[a:b] or [np.zeros(0, dt)]) for a, b in zip(doc_idx, doc_idx[1:])]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_written_corpus_reads_back_by_the_published_format(tmp_path, dtype):
    docs = random_docs(25) + [np.zeros(0, np.int64)]  # an empty document too
    prefix = write_corpus(tmp_path / "c", docs, dtype)
    theirs = read_by_the_published_format(prefix)
    ours = IndexedFile(prefix)
    assert ours.dtype == np.dtype(dtype) and len(ours) == len(docs) == len(theirs)
    for d, doc in enumerate(docs):
        assert theirs[d].tolist() == doc.tolist() == ours.document(d).tolist()


def test_megatron_core_reads_ours_and_we_read_megatron_cores(tmp_path):
    """Megatron-LM's own IndexedDataset (megatron-core, a dev requirement) as the oracle."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    docs = random_docs(30)
    ours = write_corpus(tmp_path / "ours", docs)
    theirs_view = IndexedDataset(ours)
    assert [theirs_view[i].tolist() for i in range(len(docs))] == [d.tolist() for d in docs]

    # Theirs: documents of two sequences each (sentence-split preprocessing), int32 tokens.
    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32)
    for d in docs:
        half = len(d) // 2
        builder.add_document(torch.from_numpy(d.astype(np.int32)), [half, len(d) - half])
    builder.finalize(str(tmp_path / "theirs.idx"))
    read = IndexedFile(tmp_path / "theirs")
    assert read.dtype == np.dtype(np.int32) and len(read) == len(docs)
    assert [read.document(i).tolist() for i in range(len(docs))] == [d.tolist() for d in docs]


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(32_000) == np.uint16 and token_dtype(65_536) == np.uint16
    assert token_dtype(65_537) == np.int32 and token_dtype(128_256) == np.int32


def test_corpus_path_forms(tmp_path):
    (tmp_path / "f").mkdir()
    for name in ("b", "a"):
        write_corpus(tmp_path / "f" / name, random_docs(3))
    assert indexed_prefixes(tmp_path / "f") == [
        str(tmp_path / "f" / "a"),
        str(tmp_path / "f" / "b"),
    ]
    assert indexed_prefixes(tmp_path / "f" / "a") == [str(tmp_path / "f" / "a")]
    assert indexed_prefixes(tmp_path / "f" / "a.bin") == [str(tmp_path / "f" / "a")]
    assert indexed_prefixes(tmp_path / "nothing") is None
    corpus = IndexedCorpus(indexed_prefixes(tmp_path / "f"), label="f")
    assert len(corpus) == 6 and corpus.read(4, 0, 1).size == 1


# ---- damaged files: one line each, naming the file


def test_truncated_bin(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(10))
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[:-6])
    with pytest.raises(DataError, match=r"c\.bin: .* the \.bin is truncated"):
        IndexedFile(prefix)


def test_idx_of_another_corpus(tmp_path):
    a = write_corpus(tmp_path / "a", random_docs(10))
    b = write_corpus(tmp_path / "b", random_docs(12))
    Path(a + ".idx").write_bytes(Path(b + ".idx").read_bytes())
    with pytest.raises(DataError, match=r"a\.bin: .*(truncated|longer).* another corpus"):
        IndexedFile(a)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"NOTANIDX!" + b[9:], "no MMIDIDX header"),
        (lambda b: b[:-5], "truncated or damaged"),
        (lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], "version 2"),
        (lambda b: b[:17] + struct.pack("<B", 7) + b[18:], "not an integer token dtype"),
    ],
)
def test_damaged_idx(tmp_path, damage, message):
    prefix = write_corpus(tmp_path / "c", random_docs(5))
    Path(prefix + ".idx").write_bytes(damage(Path(prefix + ".idx").read_bytes()))
    with pytest.raises(DataError, match=message):
        IndexedFile(prefix)


def test_missing_half_of_the_pair(tmp_path):
    prefix = write_corpus(tmp_path / "c", random_docs(5))
    Path(prefix + ".bin").unlink()
    with pytest.raises(DataError, match=r"c\.bin does not exist"):
        IndexedFile(prefix)


# ---- the window stream


def Store(docs: list[np.ndarray]) -> InMemoryDocs:  # noqa: N802
    return InMemoryDocs(docs, label="store")


def test_windows_cut_each_epochs_concatenation():
    docs = random_docs(20)
    w = TokenWindows(Store(docs), window=17, seed=3, shuffle=True)
    for epoch in range(3):
        order = w.order(epoch)
        stream = np.concatenate([docs[i] for i in order])
        for j in range(w.per_epoch):
            m = epoch * w.per_epoch + j
            assert w[m].tolist() == stream[j * 17 : (j + 1) * 17].tolist()
    assert not np.array_equal(w.order(0), w.order(1))  # a new permutation every epoch
    assert np.array_equal(
        w.order(1), TokenWindows(Store(docs), window=5, seed=3, shuffle=True).order(1)
    )
    plain = TokenWindows(Store(docs), window=17, seed=3, shuffle=False)
    assert plain[0].tolist() == np.concatenate(docs)[:17].tolist()


def test_too_little_data_for_one_window():
    with pytest.raises(DataError, match="has 10 tokens, fewer than one window of 11"):
        TokenWindows(Store([np.arange(10)]), window=11, seed=0, shuffle=True)
    with pytest.raises(DataError, match="is empty"):
        TokenWindows(Store([]), window=11, seed=0, shuffle=True)


def test_token_id_outside_the_vocabulary():
    w = TokenWindows(Store([np.arange(20)]), window=5, seed=0, shuffle=False, vocab_size=12)
    assert w[1].tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(DataError, match=r"token id 14 in window 2 is outside .*\[0, 12\)"):
        w[2]


# ---- the loader on a corpus folder


class FakeTokenizer:
    n_words = VOCAB

    def __init__(self, sha: str = "abc") -> None:
        self.sha = sha

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        raise AssertionError("pretokenized data is never tokenized again")

    def fingerprint(self) -> dict:
        return {
            "file": "tok.model",
            "sha256": self.sha,
            "vocab_size": VOCAB,
            "bos_id": 1,
            "eos_id": 2,
        }


def corpus_folder(tmp_path: Path, n_docs: int = 60, name: str = "corpus") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    docs = random_docs(n_docs)
    write_corpus(folder / "shard_00000", docs[: n_docs // 2])
    write_corpus(folder / "shard_00001", docs[n_docs // 2 :])
    tokens = sum(len(d) for d in docs)
    write_manifest(
        folder,
        Manifest(
            tokenizer=FakeTokenizer().fingerprint(),
            dtype="uint16",
            documents=n_docs,
            tokens=tokens,
            source={"dataset_path": "x.jsonl"},
            files=["shard_00000", "shard_00001"],
        ),
    )
    return folder


def loader(folder: Path, *, dp: int = 1, rank: int = 0, local: int = 4, gbs: int = 8, **kw):
    kw.setdefault("tokenizer", FakeTokenizer())
    return build_loader(
        dataset="python_docs",
        dataset_path=str(folder),
        local_batch_size=local,
        global_batch_size=gbs,
        seq_len=16,
        dp_rank=rank,
        dp_world_size=dp,
        seed=7,
        shuffle=True,
        **kw,
    )


def rows_of(batch) -> torch.Tensor:
    """A batch's inputs and doc_ids side by side, one row per sequence."""
    return torch.cat([batch.inputs, batch.doc_ids.long()], 1)


def global_steps(folder: Path, dp: int, local: int, steps: int, states=None) -> list[torch.Tensor]:
    """Each step's global batch (inputs and doc_ids, rows in global order) read by ``dp`` ranks."""
    loaders = [loader(folder, dp=dp, rank=r, local=local) for r in range(dp)]
    for ld, st in zip(loaders, states or [None] * dp, strict=True):
        if st is not None:
            ld.load_state_dict(st)
    its = [iter(ld) for ld in loaders]
    accum = 8 // (dp * local)
    out = []
    for _ in range(steps):
        rows = []
        for it in its:
            rows += [rows_of(next(it)) for _ in range(accum)]
        out.append(torch.cat(rows))
    return out


def test_global_batches_do_not_depend_on_the_layout(tmp_path):
    folder = corpus_folder(tmp_path)
    ref = global_steps(folder, dp=1, local=8, steps=12)  # crosses several epochs
    for dp, local in ((1, 4), (2, 4), (4, 2), (4, 1), (8, 1)):
        got = global_steps(folder, dp=dp, local=local, steps=12)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (dp, local)


def test_exact_resume_mid_epoch_and_on_another_layout(tmp_path):
    folder = corpus_folder(tmp_path)
    first = [loader(folder, dp=2, rank=r) for r in range(2)]
    its = [iter(ld) for ld in first]
    for _ in range(5):
        for it in its:
            next(it)
    saved = {}
    for ld in first:
        saved.update(
            json.loads(
                json.dumps(
                    {k: v if isinstance(v, int) else v.decode() for k, v in ld.state_dict().items()}
                )
            )
        )
    saved = {k: v if isinstance(v, int) else v.encode() for k, v in saved.items()}
    expected = [torch.cat([rows_of(next(it)) for it in its]) for _ in range(6)]
    resumed = global_steps(folder, dp=4, local=2, steps=6, states=[saved] * 4)
    assert all(torch.equal(a, b) for a, b in zip(expected, resumed, strict=True))


def test_labels_are_inputs_shifted(tmp_path):
    inputs, labels, _ = next(iter(loader(corpus_folder(tmp_path))))
    assert inputs.shape == (4, 16) and inputs.dtype == torch.long
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_one_small_document_trains_with_a_large_global_batch(tmp_path):
    folder = tmp_path / "tiny"
    folder.mkdir()
    write_corpus(folder / "only", [np.arange(40)])  # 2 windows of 17 per epoch
    got = global_steps(folder, dp=2, local=4, steps=3)
    assert all(b.shape == (8, 32) for b in got)


def test_corpus_written_with_another_tokenizer(tmp_path):
    folder = corpus_folder(tmp_path)
    with pytest.raises(DataError, match="was tokenized with tok.model .*sha256 abc vs other"):
        loader(folder, tokenizer=FakeTokenizer(sha="other"))


def test_state_of_a_text_dataset_is_refused(tmp_path):
    ld = loader(corpus_folder(tmp_path))
    text_state = {
        "virtual_shards": 8,
        **{f"shard_{v}": b'{"version":1,"streaming":false}' for v in range(8)},
    }
    with pytest.raises(ConfigError, match="saved from one text dataset"):
        ld.load_state_dict(text_state)


# ---- a Hugging Face dataset that holds token ids


@pytest.fixture
def hf_offline(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return datasets


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_a_dataset_of_input_ids_is_read_as_stored(tmp_path, hf_offline, streaming):
    docs = [d.tolist() for d in random_docs(40)]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d, "n": len(d)}) + "\n" for d in docs))
    ld = build_loader(
        dataset="python_docs",
        dataset_path=str(path),
        tokenizer=FakeTokenizer(),
        local_batch_size=1,
        seq_len=9,
        streaming=streaming,
    )
    assert isinstance(ld.sources[0], TokenWindows) != streaming  # map-style: random access
    got = torch.cat([torch.cat([x, y[:, -1:]], 1) for (x, y, _), _ in zip(ld, range(12))])
    got = got.flatten()
    stream = [t for d in docs for t in d]
    assert got.tolist() == stream[: len(got)]


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_input_ids_outside_the_vocabulary(tmp_path, hf_offline, streaming):
    path = tmp_path / "ids.jsonl"
    path.write_text(
        "".join(json.dumps({"input_ids": [1, 2, 3, VOCAB + 5, 4]}) + "\n" for _ in range(3))
    )
    ld = build_loader(
        dataset="python_docs",
        dataset_path=str(path),
        tokenizer=FakeTokenizer(),
        local_batch_size=1,
        seq_len=4,
        streaming=streaming,
    )
    with pytest.raises(
        DataError, match=rf"token id {VOCAB + 5} .*outside the tokenizer's vocabulary"
    ):
        next(iter(ld))
