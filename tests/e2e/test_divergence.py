"""The divergence guard: an absurd learning rate makes the gradients non-finite at step 2; every
rank stops there with one line naming the step and the values, and the newest checkpoint stays
the last good one (step 1)."""

from __future__ import annotations

import pytest
from launcher import launch

from torchtitan.checkpoint import scan


@pytest.mark.slow
def test_a_non_finite_step_stops_training_and_saves_nothing_after_it(tmp_path):
    out = launch(
        tmp_path,
        "--optimizer.lr",
        "1e30",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "1",
        "--training.steps",
        "6",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "4",
        "--metrics.log_freq",
        "1",
        ngpu=2,
    )
    assert out.returncode == 3, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    folder = tmp_path / "out" / "checkpoint"
    assert len(errors) == 1, out.stderr[-3000:]
    assert "step 2: not finite:" in errors[0] and "gradient norm nan" in errors[0]
    assert f"(newest checkpoint: {folder / 'step-1'})" in errors[0]
    assert "Traceback" not in out.stderr
    assert [(c.step, c.complete) for c in scan(str(folder))] == [(1, True)]
    assert "step: 1 " in out.stdout and "step: 2 " not in out.stdout
