"""The launcher's torchrun acts on the first stop signal and ignores the ones after it (the whole
run, signalled three times, is tests/e2e/test_preemption.py)."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing import api

from torchtitan.resilience.torchrun import acting_once


def test_the_first_signal_raises_as_torchrun_does_and_later_ones_change_nothing():
    handler = acting_once(api._terminate_process_handler)
    with pytest.raises(api.SignalException) as first:
        handler(signal.SIGUSR1, None)
    assert first.value.sigval == signal.SIGUSR1
    assert handler(signal.SIGUSR1, None) is None
    assert handler(signal.SIGTERM, None) is None


def test_each_wrapped_handler_keeps_its_own_count():
    calls: list[int] = []
    a, b = acting_once(lambda s, f: calls.append(s)), acting_once(lambda s, f: calls.append(-s))
    a(10, None), a(10, None), b(15, None), b(15, None)
    assert calls == [10, -15]
