"""Each rank compiles into its own inductor cache folder (``per_rank_compile_cache``): torch
2.13's AOTAutograd cache gives every rank the same key for a DTensor graph, so one shared folder
hands a rank another rank's backward (the measured wrong gradients are in
tests/e2e/test_moe_parallel.py::test_gradients_under_tensor_parallel_...[compiled_blocks])."""

from __future__ import annotations

import os

from torchtitan.distributed.utils import per_rank_compile_cache


def test_each_rank_gets_a_folder_inside_the_one_set(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("RANK", "3")
    per_rank_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor" / "rank_3")
    per_rank_compile_cache()  # a second call (a worker that initializes twice) adds nothing
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor" / "rank_3")


def test_inside_the_default_folder_when_none_is_set(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("RANK", "0")
    per_rank_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(default_cache_dir(), "rank_0")


def test_one_process_keeps_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("RANK", raising=False)
    per_rank_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
