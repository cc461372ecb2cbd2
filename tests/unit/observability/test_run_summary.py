"""The share done and the time left on each step line, the end-of-run summary block, and the
TensorBoard run folder a resumed run continues."""

from __future__ import annotations

import os

from torchtitan.observability.run_summary import WINDOW, Progress, Summary, clock, summary_lines
from torchtitan.observability.sinks import newest_tb_run


def test_the_time_left_comes_from_the_recent_steps():
    progress = Progress(total=100)
    progress.mark(1, now=0.0)
    assert progress.text(1) == "1/100 1%  ETA --"  # one step gives no step time yet
    progress.mark(2, now=30.0)  # the first step's compilation is in this interval...
    for step in range(3, 3 + WINDOW):
        progress.mark(step, now=30.0 + (step - 2) * 2.0)
    # ...and falls out of the window: 2 s a step, 100 - 12 steps left
    assert progress.seconds_left(12) == 88 * 2.0
    assert progress.text(12) == "12/100 12%  ETA 0:02:56"
    assert progress.seconds_left(100) == 0.0


def test_clock():
    assert clock(0) == "0:00:00"
    assert clock(3725.4) == "1:02:05"
    assert clock(2 * 86400 + 61) == "2d 0:01:01"


def _summary(**changed) -> Summary:
    values = {
        "first_step": 9,
        "last_step": 10,
        "tokens_run": 1024,
        "tokens_all": 5120,
        "wall_s": 21.2,
        "train_s": 3.4,
        "loss": 7.84081,
        "validation": None,
        "tokens_per_s": 288.4,
        "mfu_pct": None,
        "checkpoint": "/x/checkpoint/step-10",
        "hf_export": None,
        "tensorboard": "/x/tb/run",
    }
    return Summary(**(values | changed))


def test_the_summary_block():
    assert summary_lines(_summary()) == [
        "Run summary",
        "  steps         9-10 this run (2), 10 in all",
        "  tokens        1,024 this run, 5,120 in all",
        "  wall time     0:00:21 (training loop 0:00:03)",
        "  final loss    7.8408 (training, step 10)",
        "  throughput    288 tokens/s per device, MFU n/a",
        "  checkpoint    /x/checkpoint/step-10",
        "  TensorBoard   /x/tb/run",
    ]
    full = summary_lines(_summary(validation=(7.9, 2697.3), mfu_pct=41.25, hf_export="/x/hf"))
    assert "  validation    loss 7.9000, perplexity 2,697.30" in full
    assert "  throughput    288 tokens/s per device, MFU 41.25%" in full
    assert "  HF export     /x/hf" in full
    off = summary_lines(_summary(checkpoint=None, tensorboard=None))
    assert "  checkpoint    none (checkpoint.enable is false)" in off
    assert "  TensorBoard   off (metrics.enable_tensorboard)" in off


def test_a_resumed_run_continues_the_newest_tensorboard_run(tmp_path):
    assert newest_tb_run(str(tmp_path / "tb")) is None
    runs = {"20261126-100000": True, "20261126-110000": True, "20261126-120000": False}
    for name, events in (runs | {"notes": True}).items():
        os.makedirs(tmp_path / "tb" / name)
        if events:
            (tmp_path / "tb" / name / "events.out.tfevents.1.host").write_bytes(b"")
    # the newest with events: a run folder created by a start that wrote nothing does not count
    assert newest_tb_run(str(tmp_path / "tb")) == str(tmp_path / "tb" / "20261126-110000")
