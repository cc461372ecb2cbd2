"""``[training.dataloader]`` worker processes (torchtitan/data/workers.py): the same batches as
the loader in the training process, and a state that resumes exactly, with or without workers,
however far ahead the workers have read.

Everything runs offline on tiny local files (a byte tokenizer); each test forks its workers."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from loaders import build_loader
from offline_data import ByteTokenizer, use_offline_caches

from torchtitan.data.workers import WorkerLoader
from torchtitan.errors import ConfigError, DataError

TOK = ByteTokenizer()


@pytest.fixture(autouse=True)
def offline_tmp_caches(tmp_path_factory, monkeypatch):
    use_offline_caches(
        monkeypatch, tmp_path_factory.mktemp("hf_cache"), tmp_path_factory.mktemp("tt_cache")
    )


def _jsonl(path: Path, n: int, prefix: str = "doc") -> Path:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(
                json.dumps({"text": f"{prefix} {i:03d}:" + "abcdefghij"[: (i * 3) % 11]}) + "\n"
            )
    return path


def _build(path: Path, **kw):
    args = dict(
        dataset="local",
        dataset_path=str(path),
        tokenizer=TOK,
        local_batch_size=4,
        seq_len=5,
        global_batch_size=8,
        dp_world_size=2,
    )
    return build_loader(**(args | kw))


def _take(loader, n: int) -> list:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert all(torch.equal(u, v) for u, v in zip(x, y))


def _sources(tmp_path: Path, kind: str) -> dict:
    """A text source (map-style, shuffled or streamed) or a weighted mixture of two."""
    path = _jsonl(tmp_path / "a.jsonl", 23)
    if kind == "mixture":
        other = _jsonl(tmp_path / "b.jsonl", 17, prefix="other")
        entries = [
            {"path": str(path), "weight": 0.7, "name": "a"},
            {"path": str(other), "weight": 0.3, "name": "b"},
        ]
        return {"datasets": json.dumps(entries), "dataset_path": None}
    if kind == "shuffled":
        return {"dataset_path": str(path), "shuffle": True, "seed": 3}
    return {"dataset_path": str(path), "streaming": kind == "streamed"}


@pytest.mark.parametrize("kind", ["map", "shuffled", "streamed", "mixture"])
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_give_the_batches_and_a_state_that_resumes_exactly(tmp_path, kind, workers):
    make = lambda: _build(tmp_path, dp_rank=1, **_sources(tmp_path, kind))  # noqa: E731
    reference = _take(make(), 14)
    loader = WorkerLoader(make(), workers, prefetch_factor=3)
    first = _take(loader, 5)  # the workers have read further ahead than these
    _assert_same(first, reference[:5])
    state = _roundtrip(loader.state_dict())
    assert loader.tokens_per_source() == make_after(make, 5).tokens_per_source()
    # the state resumes a loader without workers, and one with workers, at batch 6
    plain = make()
    plain.load_state_dict(state)
    _assert_same(_take(plain, 9), reference[5:])
    again = WorkerLoader(make(), workers)
    again.load_state_dict(state)
    _assert_same(_take(again, 9), reference[5:])


def make_after(make, n: int):
    """A loader without workers that has yielded ``n`` batches."""
    loader = make()
    _take(loader, n)
    return loader


def test_a_state_without_workers_resumes_with_them(tmp_path):
    make = lambda: _build(tmp_path, **_sources(tmp_path, "streamed"))  # noqa: E731
    reference = _take(make(), 10)
    plain = make_after(make, 3)
    loader = WorkerLoader(make(), 2)
    loader.load_state_dict(_roundtrip(plain.state_dict()))
    _assert_same(_take(loader, 7), reference[3:])
    # a new iter() goes on from the last batch taken, not from where the workers had read to
    _assert_same(_take(loader, 2), _take(make_after(make, 10), 2))


def test_more_workers_than_rows_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"num_workers: 5 workers, .*local_batch_size is 4"):
        WorkerLoader(_build(tmp_path, **_sources(tmp_path, "map")), 5)


def test_a_data_error_in_a_worker_is_raised_as_itself(tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [{"text": f"row {i} " * 3} for i in range(12)] + [{"body": "no text"}] * 12
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loader = WorkerLoader(_build(tmp_path, dataset_path=str(path), streaming=True), 2)
    with pytest.raises(DataError) as e:
        _take(loader, 50)
    assert "\n" not in str(e.value) and "text" in str(e.value)
