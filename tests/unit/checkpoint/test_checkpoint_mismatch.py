"""A checkpoint of another configuration is one line per difference, naming the key, both values
and what to pass; one that lacks what its own run wrote is damaged (the manager falls back past
those only). Pure functions over the recorded facts and DCP's metadata; the runs that meet them
are in tests/e2e/test_checkpoint.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)

from torchtitan.checkpoint.mismatch import check, run_facts

PATH = "/ckpt/step-8"


def _facts(**changed):
    facts = {
        "global_batch_size": 8,
        "local_batch_size": 8,
        "dp": 1,
        "model_name": "llama3",
        "flavor": "debugmodel",
        "vocab_size": 2256,
        "parameters": 5_876_992,
        "optimizer": "AdamW",
    }
    return run_facts(**(facts | changed))


def _tensor(*shape: int) -> TensorStorageMetadata:
    chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=torch.Size(shape))
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), [chunk])


def _checkpoint(shards: int = 8, dim: int = 4) -> dict:
    """The metadata of a tiny training state: two weights, AdamW moments, the loader's shards."""
    meta = {"model.w": _tensor(dim, dim), "model.norm": _tensor(dim)}
    meta |= {
        "optimizer.state.w.exp_avg": _tensor(dim, dim),
        "train_state.step": BytesStorageMetadata(),
    }
    meta |= {f"dataloader.shard_{i}": BytesStorageMetadata() for i in range(shards)}
    return meta


def _wanted(shards: int = 8, dim: int = 4, moment: str = "exp_avg") -> dict:
    flat = {"model.w": torch.empty(dim, dim), "model.norm": torch.empty(dim)}
    flat |= {f"optimizer.state.w.{moment}": torch.empty(dim, dim), "train_state.step": 0}
    return flat | {f"dataloader.shard_{i}": {} for i in range(shards)}


def test_the_same_configuration_on_another_layout_passes():
    # another data-parallel degree and local batch with the same global batch continue exactly
    assert check(PATH, _facts(), _facts(dp=2, local_batch_size=4), _wanted(), _checkpoint()) is None


@pytest.mark.parametrize(
    "now, expected",
    [
        (
            _facts(global_batch_size=16, dp=2),
            "training.global_batch_size: /ckpt/step-8 was trained with a global batch of 8 "
            "sequences and this run has 16 (by default local_batch_size x the data-parallel "
            "degree, which changes with the number of processes); pass "
            "--training.global_batch_size 8 --training.local_batch_size 4 to continue it exactly, "
            "or --checkpoint.exclude_from_loading dataloader to start the data over with the new "
            "batch",
        ),
        (
            _facts(flavor="8B", parameters=8_000_000_000),
            "model.flavor: /ckpt/step-8 holds a llama3 'debugmodel' model and this run builds "
            "llama3 '8B'; pass --model.name llama3 --model.flavor debugmodel to resume it",
        ),
        (
            _facts(vocab_size=128_256, parameters=6_000_000),
            "model.tokenizer_path: /ckpt/step-8 was trained with a vocabulary of 2,256 tokens and "
            "this run's tokenizer has 128,256; resume with the tokenizer it was trained with",
        ),
        (
            _facts(parameters=4_000_000),
            "model.flavor: /ckpt/step-8 holds a llama3 'debugmodel' of 5,876,992 parameters and "
            "this run builds one of 4,000,000: resume with the model overrides it was trained "
            "with (model.n_layers, model.dim, ...)",
        ),
        (
            _facts(optimizer="Muon"),
            "optimizer.name: /ckpt/step-8 holds AdamW's state and this run uses Muon; pass "
            "--optimizer.name AdamW to resume it, or --checkpoint.exclude_from_loading optimizer "
            "to start the optimizer afresh",
        ),
    ],
    ids=["global_batch", "flavor", "vocabulary", "overrides", "optimizer"],
)
def test_a_recorded_difference_is_one_line_with_the_fix(now, expected):
    assert check(PATH, _facts(), now, _wanted(), _checkpoint()) == ("mismatch", expected)


def test_a_batch_no_local_batch_can_give_names_the_data_parallel_degree():
    now = _facts(global_batch_size=9, dp=3, local_batch_size=3)
    kind, line = check(PATH, _facts(), now, _wanted(), _checkpoint())
    assert kind == "mismatch"
    assert "a data-parallel degree that divides 8 (this run's is 3)" in line


def test_what_its_own_run_wrote_but_is_missing_is_damage_not_a_mismatch():
    meta = _checkpoint()
    del meta["model.w"]
    kind, line = check(PATH, _facts(), _facts(), _wanted(), meta)
    assert kind == "damaged"
    assert line.startswith(f"checkpoint {PATH} lacks 1 parameters that the run which wrote it")


@pytest.mark.parametrize(
    "wanted, expected",
    [
        (
            _wanted(shards=16),
            "training.global_batch_size: /ckpt/step-8 was trained with a global batch of 8 "
            "sequences and this run has 16",
        ),
        (
            _wanted(dim=8),
            "model.flavor: /ckpt/step-8 holds w of shape [4, 4] and this model's is [8, 8]",
        ),
        (
            _wanted(moment="momentum_buffer"),
            "/ckpt/step-8 has no 'optimizer' entries this run loads "
            "(optimizer.state.w.momentum_buffer, 1 in all): it was saved by another "
            "configuration; pass --checkpoint.exclude_from_loading optimizer",
        ),
    ],
    ids=["global_batch", "shape", "optimizer_state"],
)
def test_a_checkpoint_without_recorded_facts_is_read_from_its_metadata(wanted, expected):
    kind, line = check(PATH, {}, _facts(), wanted, _checkpoint())
    assert kind == "mismatch" and line.startswith(expected), line


def test_model_weights_missing_from_an_unrecorded_checkpoint_name_another_model():
    wanted = _wanted() | {f"model.layers.{i}.w": torch.empty(2) for i in range(5)}
    kind, line = check(PATH, {}, _facts(), wanted, _checkpoint())
    assert kind == "mismatch"
    assert line.startswith(f"model.flavor: {PATH} lacks 5 weights of this model (layers.0.w, ")
