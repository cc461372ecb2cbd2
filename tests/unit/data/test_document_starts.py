"""Where documents start: the ``doc_ids`` of every batch and the ``mask_document_starts`` labels,
for every kind of source, across a resume, and from a state saved before the starts were kept.

The expected boundaries come from the tokens alone, not from the loader: every document written
here starts with a mark the rest of the data never holds (BOS for text and for the mixed corpus; a
value of its own for documents of token ids, each of which repeats one value), so ``is_start``
finds where documents start in a window without knowing how the loader packed them.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from loaders import build_loader
from offline_data import ByteTokenizer, use_offline_caches

from torchtitan.data.batch import IGNORE_INDEX, Batch, make_batch
from torchtitan.data.indexed import IndexedWriter
from torchtitan.data.token_windows import InMemoryDocs, TokenWindows, epoch_permutation
from torchtitan.errors import ConfigError

TOK = ByteTokenizer()
SEQ = 7  # windows of 8 tokens; the documents are 9 to 23 tokens long

IsStart = Callable[[np.ndarray], np.ndarray]


@pytest.fixture(autouse=True)
def offline_tmp_caches(tmp_path_factory, monkeypatch):
    hf_cache = tmp_path_factory.mktemp("hf_datasets_cache")
    use_offline_caches(monkeypatch, hf_cache, tmp_path_factory.mktemp("torchtitan_cache"))


# ---- data and expectations


def texts(n: int) -> list[str]:
    """Distinct documents of 7 to 21 bytes."""
    return [f"doc {i:02d} " + "abcdefghijklmn"[: (i * 5) % 15] for i in range(n)]


def write_texts(path: Path, docs: list[str]) -> Path:
    if path.suffix == ".parquet":
        datasets.Dataset.from_dict({"text": docs}).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    return path


def id_docs(n: int) -> list[list[int]]:
    """Document ``k`` repeats the value ``k + 1``, 0 to 12 times (document 12 is empty)."""
    return [[k + 1] * (((k + 1) * 7) % 13) for k in range(n)]


def write_indexed(folder: Path, docs: list[list[int]]) -> Path:
    folder.mkdir()
    w = IndexedWriter(folder / "part", np.dtype(np.uint16))
    for d in docs:
        w.add(np.asarray(d, dtype=np.int64))
    w.close()
    return folder


def bos_start(w: np.ndarray) -> np.ndarray:
    return w == TOK.bos_id


def value_start(w: np.ndarray) -> np.ndarray:
    """Documents of one repeated value each: one starts where the value changes (position 0 of a
    window is unknown, and does not matter: no label and no doc_id depend on it)."""
    out = np.zeros(w.shape, dtype=bool)
    out[:, 1:] = w[:, 1:] != w[:, :-1]
    return out


def windows_of(batch: Batch) -> np.ndarray:
    """The ``seq_len + 1`` windows an unmasked batch was cut from."""
    return torch.cat([batch.inputs, batch.labels[:, -1:]], 1).numpy()


def expected_doc_ids(starts: np.ndarray) -> np.ndarray:
    """By definition: position ``t`` is in document number (starts at window positions 1..t)."""
    out = np.zeros((starts.shape[0], starts.shape[1] - 1), dtype=np.int32)
    for t in range(1, out.shape[1]):
        out[:, t] = starts[:, 1 : t + 1].sum(axis=1)
    return out


def take(loader, n: int) -> list[Batch]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def roundtrip(state: dict) -> dict:
    """As a checkpoint would: through torch.save / torch.load."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def assert_same(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert all(torch.equal(u, v) for u, v in zip(x, y, strict=True))


def check_boundaries(make: Callable[..., object], is_start: IsStart, batches: int = 16) -> None:
    """``make(mask_document_starts=...)``'s batches: doc_ids number the documents ``is_start``
    finds, and with masking the labels are IGNORE_INDEX exactly before a start."""
    plain = take(make(mask_document_starts=False), batches)
    masked = take(make(mask_document_starts=True), batches)
    seen = 0
    for p, m in zip(plain, masked, strict=True):
        starts = is_start(windows_of(p))
        assert p.doc_ids.dtype == torch.int32 and p.doc_ids.shape == p.inputs.shape
        assert (p.doc_ids[:, 0] == 0).all()
        assert np.array_equal(p.doc_ids.numpy(), expected_doc_ids(starts))
        assert torch.equal(m.inputs, p.inputs) and torch.equal(m.doc_ids, p.doc_ids)
        assert np.array_equal(m.labels.numpy(), np.where(starts[:, 1:], IGNORE_INDEX, p.labels))
        seen += int(starts[:, 1:].sum())
    assert seen >= batches // 2  # documents do start inside the rows


def text_loader(path: Path, **kw):
    args = dict(
        dataset="local", dataset_path=str(path), tokenizer=TOK, local_batch_size=2, seq_len=SEQ
    )
    return build_loader(**{**args, **kw})


# ---- make_batch


def test_make_batch_by_hand():
    windows = torch.tensor([[9, 256, 1, 2, 257, 256], [3, 257, 256, 4, 5, 6]])
    starts = np.array([[0, 1, 0, 0, 0, 1], [1, 0, 1, 0, 0, 0]], dtype=bool)
    plain = make_batch(windows.clone(), starts, mask_document_starts=False)
    assert plain.inputs.tolist() == [[9, 256, 1, 2, 257], [3, 257, 256, 4, 5]]
    assert plain.labels.tolist() == [[256, 1, 2, 257, 256], [257, 256, 4, 5, 6]]
    assert plain.doc_ids.tolist() == [[0, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert plain.doc_ids.dtype == torch.int32
    masked = make_batch(windows.clone(), starts, mask_document_starts=True)
    assert masked.labels.tolist() == [[-100, 1, 2, 257, -100], [257, -100, 4, 5, 6]]
    assert torch.equal(masked.inputs, plain.inputs) and torch.equal(masked.doc_ids, plain.doc_ids)
    # one row: masking the labels leaves the inputs (and the caller's window) alone
    one = windows[:1].clone()
    single = make_batch(one, starts[:1], mask_document_starts=True)
    assert single.inputs.tolist() == [[9, 256, 1, 2, 257]] and torch.equal(one, windows[:1])
    assert single.labels.tolist() == [[-100, 1, 2, 257, -100]]


def test_token_windows_flag_each_documents_first_token():
    lengths = [3, 0, 5, 2, 7, 4]
    docs = [np.full(n, k + 1, dtype=np.int64) for k, n in enumerate(lengths)]
    tw = TokenWindows(InMemoryDocs(docs, label="mem"), window=4, seed=5, shuffle=True)
    for m in range(3 * tw.per_epoch):  # three epochs, each in its own order
        epoch, j = divmod(m, tw.per_epoch)
        order = epoch_permutation(len(docs), 5, epoch)
        ordered = [lengths[d] for d in order]
        firsts = {s for s, n in zip(np.cumsum([0] + ordered[:-1]), ordered, strict=True) if n}
        tokens, starts = tw.window_with_starts(m)
        assert [p for p in range(4) if starts[p]] == [p for p in range(4) if j * 4 + p in firsts]
        assert starts.dtype == bool and np.array_equal(tw[m], tokens)


# ---- every kind of source


@pytest.mark.parametrize(
    "name,streaming,shuffle",
    [
        ("d.jsonl", False, False),
        ("d.jsonl", False, True),
        ("d.parquet", False, False),
        ("d.jsonl", True, False),
        ("d.jsonl", True, True),
    ],
    ids=["map", "map-shuffled", "parquet", "streamed", "streamed-shuffled"],
)
def test_text_tokenized_on_the_fly(tmp_path, name, streaming, shuffle):
    path = write_texts(tmp_path / name, texts(20))
    kw = dict(streaming=streaming, shuffle=shuffle, seed=4, shuffle_buffer=3)
    check_boundaries(lambda **m: text_loader(path, **kw, **m), bos_start, batches=24)


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_rows_of_token_ids(tmp_path, streaming):
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": d}) + "\n" for d in id_docs(30)))

    def make(**kw):
        return text_loader(path, streaming=streaming, local_batch_size=1, **kw)

    assert isinstance(make().sources[0], TokenWindows) != streaming  # map-style: random access
    check_boundaries(make, value_start, batches=20)


@pytest.mark.parametrize("shuffle", [False, True], ids=["ordered", "shuffled"])
def test_pretokenized_corpus_without_bos(tmp_path, shuffle):
    folder = write_indexed(tmp_path / "tok", id_docs(40))
    make = lambda **kw: text_loader(folder, local_batch_size=4, shuffle=shuffle, seed=2, **kw)  # noqa: E731
    check_boundaries(make, value_start, batches=12)  # several epochs of ~30 windows


def test_small_corpus_tokenized_whole(tmp_path):
    path = write_texts(tmp_path / "d.jsonl", texts(3))
    make = lambda **kw: text_loader(path, local_batch_size=8, **kw)  # noqa: E731
    assert isinstance(make().sources[0].store, InMemoryDocs)
    check_boundaries(make, bos_start, batches=6)


def mixture(tmp_path: Path) -> list[dict]:
    text = write_texts(tmp_path / "web.jsonl", texts(30))
    tok = write_indexed(tmp_path / "tok", [TOK.encode(t, bos=True, eos=True) for t in texts(25)])
    return [
        {"path": str(text), "weight": 2, "name": "web"},
        {"path": str(tok), "weight": 1, "name": "tok"},
    ]


def mixed(entries: list[dict], **kw):
    return build_loader(
        dataset="python_docs",
        dataset_path=None,
        tokenizer=TOK,
        local_batch_size=2,
        global_batch_size=4,
        seq_len=SEQ,
        datasets=entries,
        seed=1,
        shuffle=True,
        **kw,
    )


def test_a_mixture_of_text_and_a_pretokenized_corpus(tmp_path):
    entries = mixture(tmp_path)
    check_boundaries(lambda **kw: mixed(entries, **kw), bos_start, batches=16)


# ---- resume


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_resume_gives_the_same_doc_ids(tmp_path, streaming):
    path = write_texts(tmp_path / "d.jsonl", texts(12))

    def make():
        return text_loader(
            path,
            streaming=streaming,
            local_batch_size=1,
            mask_document_starts=True,
            shuffle=True,
            shuffle_buffer=3,
        )

    reference = take(make(), 16)
    inside = 0
    for k in range(1, 10):
        saved = make()
        take(saved, k)
        state = roundtrip(saved.state_dict())
        inside += bool(json.loads(state["shard_0"])["buffer"])  # resumes inside a document
        resumed = make()
        resumed.load_state_dict(state)
        assert_same(take(resumed, 6), reference[k : k + 6])
    assert inside >= 5


def test_a_mixture_resumes_with_the_same_doc_ids(tmp_path):
    entries = mixture(tmp_path)
    reference = take(mixed(entries, mask_document_starts=True), 14)
    for k in (2, 5, 7):  # 5 and 7: inside a step (two microbatches of two rows)
        saved = mixed(entries, mask_document_starts=True)
        take(saved, k)
        resumed = mixed(entries, mask_document_starts=True)
        resumed.load_state_dict(roundtrip(saved.state_dict()))
        assert_same(take(resumed, 7), reference[k : k + 7])


def eager_state(state: dict, docs: list[str], extra: int) -> tuple[dict, list[int]]:
    """The same position as ``state`` (one map-style shard in stored order), saved as a reader
    that had already read the next ``extra`` documents would save it: those documents in the
    leftover buffer, their starts in ``"starts"``. Returns it and those starts."""
    shard = json.loads(state["shard_0"])
    row, buffer, starts = shard["row"], list(shard["buffer"]), []
    for text in docs[row : row + extra]:
        starts.append(len(buffer))
        buffer += TOK.encode(text, bos=True, eos=True)
    assert len(starts) == extra, "the saved position is too near the end of the epoch"
    shard.update(row=row + extra, buffer=buffer, starts=starts)
    return {**state, "shard_0": json.dumps(shard).encode()}, starts


def test_a_leftover_holding_document_starts(tmp_path):
    """A saved leftover with documents starting inside it resumes with the same doc_ids."""
    docs = texts(30)
    path = write_texts(tmp_path / "d.jsonl", docs)
    make = lambda: text_loader(path, local_batch_size=1, mask_document_starts=True)  # noqa: E731
    reference = take(make(), 12)
    saved = make()
    take(saved, 4)
    state, starts = eager_state(roundtrip(saved.state_dict()), docs, extra=3)
    assert any(p % (SEQ + 1) for p in starts)  # some of them change a doc_id
    resumed = make()
    resumed.load_state_dict(state)
    assert_same(take(resumed, 8), reference[4:])


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streamed"])
def test_a_state_of_the_old_format_resumes_exactly(tmp_path, streaming):
    """A state without ``"starts"`` loads. The reader reads a document only while its buffer is
    shorter than a window, so every document read starts inside the window cut next: a saved
    leftover is the rest of one document, and the old format lost nothing."""
    path = write_texts(tmp_path / "d.jsonl", texts(12))
    make = lambda: text_loader(path, streaming=streaming, mask_document_starts=True)  # noqa: E731
    reference = take(make(), 14)
    for k in (1, 3, 6):
        saved = make()
        take(saved, k)
        state = roundtrip(saved.state_dict())
        for key in ("shard_0", "shard_1"):
            shard = json.loads(state[key])
            assert shard.pop("starts") == []
            state[key] = json.dumps(shard).encode()
        resumed = make()
        resumed.load_state_dict(state)
        assert_same(take(resumed, 8), reference[k : k + 8])


def test_an_old_format_leftover_is_one_document(tmp_path):
    """Without ``"starts"``, a leftover holding document starts (as an eager reader would have
    saved it) is read as one document: the same tokens, its starts gone, the later ones kept."""
    docs = texts(30)
    path = write_texts(tmp_path / "d.jsonl", docs)
    k, n = 4, 8
    plain = take(text_loader(path, local_batch_size=1), k + n)[k:]
    saved = text_loader(path, local_batch_size=1)
    take(saved, k)
    state, _ = eager_state(roundtrip(saved.state_dict()), docs, extra=3)
    shard = json.loads(state["shard_0"])
    del shard["starts"]
    leftover = len(shard["buffer"])
    resumed = text_loader(path, local_batch_size=1, mask_document_starts=True)
    resumed.load_state_dict({**state, "shard_0": json.dumps(shard).encode()})
    got = take(resumed, n)
    stream_starts = bos_start(np.concatenate([windows_of(b) for b in plain]).reshape(1, -1))
    stream_starts[0, :leftover] = False
    starts = stream_starts.reshape(n, SEQ + 1)
    assert np.array_equal(torch.cat([b.doc_ids for b in got]).numpy(), expected_doc_ids(starts))
    labels = torch.cat([b.labels for b in plain]).numpy()
    assert np.array_equal(
        torch.cat([b.labels for b in got]).numpy(), np.where(starts[:, 1:], IGNORE_INDEX, labels)
    )
    assert torch.equal(torch.cat([b.inputs for b in got]), torch.cat([b.inputs for b in plain]))
    assert not all(torch.equal(b.doc_ids, r.doc_ids) for b, r in zip(got, plain, strict=True))


def test_damaged_document_starts_are_refused(tmp_path):
    path = write_texts(tmp_path / "d.jsonl", texts(12))
    saved = text_loader(path, local_batch_size=1)
    take(saved, 3)
    blob = json.loads(saved.state_dict()["shard_0"])
    blob["starts"] = [len(blob["buffer"]) + 4]
    with pytest.raises(ConfigError, match=r"document starts \[\d+\] that are not ascending"):
        text_loader(path, local_batch_size=1).load_state_dict(
            {"virtual_shards": 1, "shard_0": json.dumps(blob).encode()}
        )
