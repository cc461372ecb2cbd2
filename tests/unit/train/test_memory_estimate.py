"""The fast trace of the memory estimate (torchtitan/train/memory_estimate.py): the repeat of
a stack, which decides the two short depths it traces (against the full trace:
tests/e2e/test_memory_trace.py)."""

from __future__ import annotations

import pytest

from torchtitan.train.memory_estimate import _period


@pytest.mark.parametrize(
    "kinds, period",
    [
        ("aaaaaa", (0, 1)),  # a plain stack
        ("dddaaaaa", (3, 1)),  # dense layers first (DeepSeek's n_dense_layers)
        ("abababab", (0, 2)),  # alternating kinds (gpt-oss's sliding and full attention)
        ("lllflllf", (0, 4)),  # Qwen3-Next: three linear-attention layers, then a full one
        ("abcdefghij", None),  # no repeat within 8 layers
    ],
)
def test_the_repeat_of_a_stack(kinds, period):
    assert _period(list(kinds)) == period


def _residency(schedule, pp, num_stages, n, rank, csv=""):
    from types import SimpleNamespace

    from torchtitan.distributed.pipeline import PipelinePlan
    from torchtitan.train.memory_estimate import stage_residency

    plan = PipelinePlan(schedule, pp, ((),) * num_stages, 1, n, csv)
    return stage_residency(SimpleNamespace(pipeline=plan), rank, plan.stages_of(rank))


@pytest.mark.parametrize(
    "schedule, stages, n, rank, residency",
    [
        # 1F1B: pp - rank forwards, then a backward and a forward in turn: with more
        # micro-batches than the warm-up, as many held after the first backward as before
        ("1F1B", 4, 8, 0, [(4, 4)]),
        ("1F1B", 4, 8, 3, [(1, 1)]),
        ("1F1B", 4, 4, 0, [(4, 3)]),  # no forward after the first backward
        ("GPipe", 4, 8, 2, [(8, 7)]),
        # torch's Interleaved1F1B on rank 0 (pp 4, 8 micro-batches): 0F0-0F3 4F0-4F3 0F4-0F6
        # 4B0 0F7 4B1 4F4 4B2 4F5 4B3 4F6 0B0 4F7 0B1 ...: stage 0 holds all 8 before its first
        # backward; stage 4 holds 4, and again 4 after 4F4
        ("Interleaved1F1B", 8, 8, 0, [(8, 7), (4, 4)]),
        # zero bubble: an input backward (I) keeps the activations for the weight half (W)
        ("InterleavedZeroBubble", 8, 8, 3, [(8, 7), (4, 4)]),
        ("ZBVZeroBubble", 8, 8, 0, [(8, 7), (1, 1)]),
        ("DualPipeV", 8, 8, 3, [(5, 5), (4, 4)]),
    ],
)
def test_a_stage_holds_what_its_schedule_holds(schedule, stages, n, rank, residency):
    """The micro-batches each local stage holds before and while its gradients exist, in the
    order torch's schedule runs the rank's actions."""
    assert _residency(schedule, 4, stages, n, rank) == residency


def test_a_csv_order_is_the_one_followed(tmp_path):
    """A schedule CSV file's row is the rank's order: a GPipe-like row holds every micro-batch."""
    path = tmp_path / "order.csv"
    rows = [[f"{r}F{m}" for m in range(4)] + [f"{r}B{m}" for m in range(4)] for r in range(2)]
    path.write_text("\n".join(",".join(row) for row in rows) + "\n")
    assert _residency("PipelineScheduleSingle", 2, 2, 4, 1, str(path)) == [(4, 3)]


def test_a_torch_that_cannot_lay_out_the_schedule_gets_the_most_held(monkeypatch):
    """Where torch's schedule class cannot be laid out from stand-in stages, every local
    stage holds every micro-batch (an upper bound)."""
    import torch.distributed.pipelining.schedules as schedules

    from torchtitan.distributed import pipeline

    def unknown(name):
        raise AttributeError("this torch's stage has more to read")

    monkeypatch.setattr(schedules, "get_schedule_class", unknown)
    pipeline.schedule_order.cache_clear()
    try:
        assert _residency("Interleaved1F1B", 4, 8, 8, 0) == [(8, 7), (8, 7)]
    finally:
        pipeline.schedule_order.cache_clear()


@pytest.mark.parametrize(
    "before, after, order",
    [(1, 0, "FB"), (1, 1, "FBFB"), (4, 4, "FFFFBFBBBB"), (4, 3, "FFFFBBBB"), (5, 2, "FFFFFBBBBB")],
)
def test_the_trace_meets_both_peaks(before, after, order):
    from torchtitan.train.memory_estimate import trace_order

    assert trace_order(before, after) == order
