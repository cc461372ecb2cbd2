"""The data loader throughput benchmark (benchmarks/dataloader_throughput.py) runs and reports
sane numbers. No timing thresholds: performance is shown by the benchmark, not asserted here.
(Its target arithmetic is checked in tests/unit/benchmarks/test_dataloader_throughput.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT

SCRIPT = ROOT / "benchmarks" / "dataloader_throughput.py"


def run_bench(tmp_path: Path, *args: str) -> dict:
    """Run the benchmark in its own process (it pins itself to one core) with private caches."""
    env = dict(
        os.environ,
        TORCHTITAN_CACHE=str(tmp_path / "torchtitan_cache"),
        HF_DATASETS_CACHE=str(tmp_path / "hf_cache"),
        HF_HUB_OFFLINE="1",
    )
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def check_row(row: dict, *, batches: int, local_batch_size: int, seq_len: int) -> None:
    assert row["batches"] == batches
    assert row["tokens"] == batches * local_batch_size * seq_len
    assert row["seconds"] > 0 and row["cpu_seconds"] >= 0
    assert row["tokens_per_s"] > 0
    assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["seconds"], rel=1e-3)
    assert row["headroom"] == pytest.approx(row["tokens_per_s"] / 9000, rel=1e-3, abs=1e-3)
    assert row["pass"] == (row["headroom"] >= row["required_headroom"])
    assert row["required_headroom"] == (100.0 if row["setting"].startswith("pretokenized") else 3.0)
    assert row["ms_per_batch"] == pytest.approx(row["seconds"] / batches * 1e3, rel=1e-3, abs=1e-3)
    assert row["first_batch_ms"] > 0 and row["prep_s"] >= 0 and row["tokenizer_load_s"] >= 0
    assert row["chars_per_token"] > 0
    assert row["torch_threads"] == 1


def test_debug_corpus_cold_cache(tmp_path):
    """The default setting (python_docs, test tokenizer, batch 1 x 8192) on a fresh cache."""
    result = run_bench(tmp_path, "--batches", "3", "--cold")
    assert result["benchmark"] == "dataloader_throughput"
    cfg = result["config"]
    assert cfg["dataset"] == "python_docs" and cfg["cold"] is True
    assert (cfg["local_batch_size"], cfg["seq_len"], cfg["dp_world_size"]) == (1, 8192, 1)
    assert result["host"]["threads_pinned"] is True
    assert result["target"]["gpu_tokens_per_s"] == 9000
    (row,) = result["rows"]
    check_row(row, batches=3, local_batch_size=1, seq_len=8192)
    assert row["cache"] == "fresh" and row["tokenizer_words"] == 2256
    assert Path(row["tokenizer"]).name == "tiktoken.model"
    assert result["pass"] == row["pass"]
    assert any("128,256" in note for note in result["caveats"])  # the small-vocab caveat
    # --cold used its own temporary cache, not the one in the environment
    assert not (tmp_path / "torchtitan_cache" / "pydoc_corpus").exists()


def test_local_dataset_sharded_over_ranks(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "d.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"document number {i} " + "word " * (i % 7 + 3)}) + "\n")
    result = run_bench(
        tmp_path,
        "--dataset-path",
        str(data),
        "--local-batch-size",
        "2",
        "--seq-len",
        "16",
        "--dp-world-size",
        "2",
        "--dp-rank",
        "all",
        "--batches",
        "4",
    )
    assert result["config"]["dataset_path"] == str(data)
    rows = result["rows"]
    assert [r["dp_rank"] for r in rows] == [0, 1]
    assert [r["virtual_shards"] for r in rows] == [[0, 1, 4], [2, 3, 4]]
    assert [r["rows_on_rank"] for r in rows] == [20, 20]
    assert rows[0]["first_tokens"] != rows[1]["first_tokens"]  # each rank reads its own shards
    for r in rows:
        check_row(r, batches=4, local_batch_size=2, seq_len=16)
    assert result["pass"] == all(r["pass"] for r in rows)


def test_locally_trained_bpe(tmp_path):
    pytest.importorskip("tokenizers")
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i} of the data"}) + "\n" for i in range(8)))
    cache = tmp_path / "bpe"
    args = ["--dataset-path", str(data), "--seq-len", "8", "--batches", "2"]
    args += ["--bpe-vocab", "400", "--bpe-train-mb", "1", "--bpe-cache", str(cache)]
    result = run_bench(tmp_path, *args)
    test_row, bpe_row = result["rows"]
    assert test_row["tokenizer_words"] == 2256
    assert bpe_row["tokenizer_words"] == 400 + 256  # mergeable tokens + Llama 3 special tokens
    assert bpe_row["setting"].startswith("on the fly | local BPE")
    (model,) = cache.glob("*.model")
    assert Path(bpe_row["tokenizer"]) == model
    check_row(bpe_row, batches=2, local_batch_size=1, seq_len=8)


def _small_jsonl(folder: Path) -> Path:
    folder.mkdir()
    with open(folder / "d.jsonl", "w") as f:
        for i in range(60):
            f.write(json.dumps({"text": f"document number {i} " + "word " * (i % 7 + 3)}) + "\n")
    return folder / "d.jsonl"


def test_pretokenized_corpus_next_to_tokenizing_on_the_fly(tmp_path):
    data = _small_jsonl(tmp_path / "data")
    result = run_bench(
        tmp_path,
        "--dataset-path",
        str(data),
        "--pretokenized",
        "auto",
        "--seq-len",
        "16",
        "--local-batch-size",
        "2",
        "--batches",
        "4",
    )
    fly, pre = result["rows"]
    assert fly["setting"].startswith("on the fly") and pre["setting"].startswith("pretokenized")
    for r in (fly, pre):
        check_row(r, batches=4, local_batch_size=2, seq_len=16)
    # the corpus was written into the benchmark's cache by scripts/tokenize_dataset.py
    assert list((tmp_path / "torchtitan_cache" / "bench_pretokenized").glob("*/manifest.json"))


def test_tokenize_throughput_against_datasets_map(tmp_path):
    data = _small_jsonl(tmp_path / "data")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "tokenize_throughput.py"),
            "--json",
            "--dataset-path",
            str(data),
            "--workers",
            "1,2",
        ],
        cwd=tmp_path,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["same_tokens"] is True
    methods = [(r["method"], r["workers"]) for r in result["rows"]]
    assert methods == [
        ("datasets.map(batched=True)", 1),
        ("scripts/tokenize_dataset.py", 1),
        ("scripts/tokenize_dataset.py", 2),
    ]
    assert all(r["documents"] == 60 and r["seconds"] > 0 for r in result["rows"])
