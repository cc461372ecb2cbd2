"""Each rank keys torch.compile's graph caches by its rank (``per_rank_compile_cache``): torch
2.13's AOTAutograd cache gives every rank the same key for a DTensor graph, so one key for all
hands a rank another rank's backward (the measured wrong gradients are in
tests/e2e/test_moe_parallel.py::test_gradients_under_tensor_parallel_...[compiled_blocks]). The
cache folder stays shared, so the ranks compile each kernel once."""

from __future__ import annotations

import os

import pytest
import torch
import torch.compiler.config as compiler_config

from torchtitan.distributed.utils import per_rank_compile_cache


@pytest.fixture(autouse=True)
def _restore_tag():
    before = compiler_config.cache_key_tag
    yield
    compiler_config.cache_key_tag = before


def test_each_rank_gets_its_own_tag_in_the_one_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("RANK", "3")
    compiler_config.cache_key_tag = ""
    per_rank_compile_cache()
    assert compiler_config.cache_key_tag == "rank_3"
    per_rank_compile_cache()  # a second call (a worker that initializes twice) adds nothing
    assert compiler_config.cache_key_tag == "rank_3"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_a_tag_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    compiler_config.cache_key_tag = "my-experiment"
    per_rank_compile_cache()
    per_rank_compile_cache()
    assert compiler_config.cache_key_tag == "my-experiment/rank_0"


def test_one_process_keeps_the_tag(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    compiler_config.cache_key_tag = ""
    per_rank_compile_cache()
    assert compiler_config.cache_key_tag == ""


def test_the_tag_changes_the_graph_cache_key():
    """What the tag is for: torch puts it in the FX graph (and AOTAutograd) cache key."""
    from torch._inductor.codecache import compiled_fx_graph_hash

    gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    keys = []
    for tag in ("rank_0", "rank_1", "rank_0"):
        compiler_config.cache_key_tag = tag
        keys.append(compiled_fx_graph_hash(gm, [torch.ones(2)], {}, [])[0])
    assert keys[0] != keys[1] and keys[0] == keys[2]
