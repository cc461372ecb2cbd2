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
