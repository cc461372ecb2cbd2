"""The loss-spike guard in a real 2-process run, on a pretokenized corpus made so that the spike is
real data at a known step: every window of the stream is one short token cycle the model learns
at once, except the windows of the chosen steps, which are random token ids (read in stored order,
step ``t``'s global batch is windows ``8(t-1) .. 8t-1``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from launcher import launch, pooled, tensorboard_scalars

from torchtitan.checkpoint.safe_read import read_model_weights
from torchtitan.data.indexed import IndexedWriter

SEQ_LEN, BATCH, VOCAB = 64, 8, 2256  # the debug model's tokenizer has 2,256 ids


def _corpus(folder: Path, steps: int, spikes: set[int]) -> Path:
    """One document per window (``SEQ_LEN + 1`` tokens): the cycle 5..20, or random ids for
    the windows of the steps in ``spikes``."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    cycle = np.resize(np.arange(5, 21), SEQ_LEN + 1)
    writer = IndexedWriter(folder / "corpus", np.uint16)
    for w in range(BATCH * (steps + 1)):
        spike = w // BATCH + 1 in spikes
        writer.add(rng.integers(0, VOCAB, SEQ_LEN + 1) if spike else cycle)
    writer.close()
    return folder / "corpus"


def _args(corpus: Path, steps: int) -> list[str]:
    return [
        "--training.dataset_path",
        str(corpus),
        "--training.shuffle",
        "false",
        "--training.steps",
        str(steps),
        "--training.seq_len",
        str(SEQ_LEN),
        "--training.global_batch_size",
        str(BATCH),
        "--training.local_batch_size",
        "2",
        "--metrics.log_freq",
        "1",
        "--debug.seed",
        "42",
        "--debug.deterministic",
        "--resilience.loss_spike_zscore",
        "4",
        "--resilience.loss_spike_warmup_steps",
        "8",
        "--resilience.loss_spike_window",
        "8",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1",
        "--checkpoint.keep_latest_k",
        "3",
        "--checkpoint.every_save_model_only",
        "true",  # weights only: small, compared below
    ]


def _spike_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if ": loss spike " in line]


@pytest.mark.slow
def test_spike_batches_are_skipped_their_updates_not_applied_and_training_goes_on(pools, tmp_path):
    # the cycle is learned by step 12 or so: the guard's window (8 steps) then sees a flat loss.
    # Step 20 spikes, 21 trains, 22 (the last: saved whatever happens) spikes again. In the warm
    # pool (rank 0's log as the output); the run that stops, below, goes through the launcher
    # for its exit code and error line.
    corpus = _corpus(tmp_path / "data", steps=22, spikes={20, 22})
    output = pooled(pools, tmp_path, *_args(corpus, 22), ngpu=2).stdout
    lines = _spike_lines(output)
    assert len(lines) == 2, output[-3000:]
    for line, step, n in zip(lines, (20, 22), (1, 2)):
        assert f"step {step}: loss spike " in line, lines
        first = (step - 1) * BATCH
        assert line.endswith(
            f"update skipped ({n} skipped in this run); the batch: global batch {step} of the "
            f"data stream: its sequences {first}-{first + BATCH - 1}, after "
            f"{(step - 1) * BATCH * SEQ_LEN:,} tokens"
        ), lines
    out = tmp_path / "out"
    skipped = tensorboard_scalars(out, "loss_spikes/skipped")
    assert [skipped[s] for s in (19, 20, 21, 22)] == [0, 1, 1, 2], skipped
    lr = tensorboard_scalars(out, "lr")
    assert lr[19] != lr[20] == lr[21] != lr[22], lr  # the schedule stood still at step 20
    # a skipped step is not saved (20); the last step always is (22)
    folder = out / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-19", "step-21", "step-22"]
    weights = {s: read_model_weights(str(folder / f"step-{s}")) for s in (19, 21, 22)}
    # training went on after the first spike (step 21's update), and the second spike's update
    # was not applied: the last step's weights are step 21's, bit for bit
    assert any(not torch.equal(weights[21][n], w) for n, w in weights[19].items())
    for name, before in weights[21].items():
        assert torch.equal(weights[22][name], before), name


@pytest.mark.slow
def test_spikes_in_a_row_stop_the_run_and_nothing_from_them_is_saved(tmp_path):
    corpus = _corpus(tmp_path / "data", steps=26, spikes={20, 21, 22})
    args = [*_args(corpus, 26), "--resilience.loss_spike_max_consecutive", "3"]
    run = launch(tmp_path, *args, ngpu=2)
    output = run.stdout + run.stderr
    assert run.returncode == 3, output[-3000:]  # TrainingDiverged's code
    assert [ln.split(": loss spike")[0][-7:] for ln in _spike_lines(output)] == [
        "step 20",
        "step 21",
        "step 22",
    ], output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    folder = tmp_path / "out" / "checkpoint"
    assert errors == [
        "error: steps 20-22: 3 loss spikes in a row "
        "(resilience.loss_spike_max_consecutive = 3); training stopped and nothing from these "
        f"steps is saved (newest checkpoint: {folder / 'step-19'}). Look at those batches "
        "(logged above), lower optimizer.lr, or raise resilience.loss_spike_zscore, then resume"
    ], output[-3000:]
    assert "Traceback" not in output
    assert sorted(p.name for p in folder.iterdir()) == ["step-17", "step-18", "step-19"]
