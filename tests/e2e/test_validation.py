"""Validation loss and perplexity: the same numbers under FSDP and PP as in one process, a
whole-dataset pass that ends together on every rank. (The one-line config errors are in
tests/unit/train/test_validation.py.)"""

from __future__ import annotations

import json
import math

import pytest
from launcher import pooled, tensorboard_scalars

COMMON = [
    "--training.steps",
    "4",
    "--training.seq_len",
    "64",
    "--training.global_batch_size",
    "4",
    "--debug.seed",
    "42",
    "--debug.deterministic",
    "--metrics.enable_tensorboard",
    "--validation.enable",
    "--validation.dataset",
    "python_docs",
    "--validation.freq",
    "2",
    "--validation.steps",
    "3",
]


@pytest.fixture(scope="module")
def one_process(pools, tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("val_one")
    out = pooled(pools, tmp, *COMMON, "--training.local_batch_size", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "validation: step 2  loss: " in out.stdout and "(3 batches per rank" in out.stdout
    losses = tensorboard_scalars(tmp / "out", "validation/loss")
    perplexity = tensorboard_scalars(tmp / "out", "validation/perplexity")
    assert sorted(losses) == [2, 4]
    for step, loss in losses.items():
        assert perplexity[step] == pytest.approx(math.exp(loss), rel=1e-5)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["--training.local_batch_size", "2"],  # FSDP 2: the same 4 sequences per batch, 2 per rank
        [
            "--training.local_batch_size",
            "4",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "2",
        ],
    ],
    ids=["fsdp2", "pp2"],
)
def test_validation_loss_is_the_same_under_fsdp_and_pp(pools, tmp_path, one_process, layout):
    out = pooled(pools, tmp_path, *COMMON, *layout, ngpu=2)
    assert out.returncode == 0, out.stderr[-3000:]
    losses = tensorboard_scalars(tmp_path / "out", "validation/loss")
    assert sorted(losses) == [2, 4]
    for step, loss in losses.items():
        assert abs(loss - one_process[step]) <= 1e-4, (step, loss, one_process[step])


@pytest.mark.slow
def test_a_whole_dataset_pass_ends_together_on_every_rank(pools, tmp_path):
    """steps -1 reads until the first rank runs out: 5 rows over 2 virtual shards (one per rank:
    3 rows and 2 rows) give rank 0 more windows than rank 1; both stop at rank 1's count, and
    every evaluation starts again from the beginning (the same count each time)."""
    data = tmp_path / "val.jsonl"
    rows = [{"text": "the quick brown fox jumps over the lazy dog " * 12} for _ in range(5)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = pooled(
        pools,
        tmp_path,
        *COMMON,
        "--training.local_batch_size",
        "2",
        "--validation.steps",
        "-1",
        "--validation.dataset_path",
        str(data),
        "--validation.local_batch_size",
        "1",
        ngpu=2,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if "validation: step" in line]
    assert len(lines) == 2 and all("batches per rank" in line for line in lines), lines
    counts = {line.split("(")[1].split()[0] for line in lines}
    assert len(counts) == 1 and int(counts.pop()) >= 1  # the same whole pass both times
