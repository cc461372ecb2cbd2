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


def test_interleaved_1f1b_holds_what_torchs_schedule_holds():
    """Each local stage's most micro-batches in flight, from the order of torch's own
    Interleaved1F1B actions (forwards add one to their stage, backwards take one off)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    from torchtitan.train.memory_estimate import interleaved_in_flight

    class Stage:  # what the schedule reads of its stages to lay out the actions
        def __init__(self, index, pp):
            self.stage_index, self.group_size, self.group_rank = index, pp, index % pp
            self.num_stages, self.is_first, self.is_last = 2 * pp, index == 0, index == 2 * pp - 1

    for pp, n in ((4, 4), (4, 8), (8, 8), (8, 32), (2, 6)):
        for rank in range(pp):
            stages = [Stage(rank, pp), Stage(rank + pp, pp)]
            try:
                schedule = ScheduleInterleaved1F1B(stages, n)
            except (AttributeError, TypeError) as e:  # a torch whose constructor reads more
                pytest.skip(f"ScheduleInterleaved1F1B needs more of a stage here: {e}")
            held, most = {rank: 0, rank + pp: 0}, {rank: 0, rank + pp: 0}
            for action in schedule.pipeline_order[rank]:
                if action is None:
                    continue
                if action.computation_type == _ComputationType.FORWARD:
                    held[action.stage_index] += 1
                elif action.computation_type == _ComputationType.FULL_BACKWARD:
                    held[action.stage_index] -= 1
                most[action.stage_index] = max(most[action.stage_index], held[action.stage_index])
            assert interleaved_in_flight(pp, rank, 2, n) == [most[rank], most[rank + pp]]
