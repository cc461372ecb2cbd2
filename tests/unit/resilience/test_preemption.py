"""The preemption listener in one process: a signal is only a flag until the step boundary; the
previous handlers come back afterwards. (Agreement across ranks: tests/e2e/test_preemption.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from torchtitan.config.parse import parse_args
from torchtitan.errors import ConfigError
from torchtitan.resilience.preemption import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    Interrupted,
    Preempted,
    Preemption,
)


def test_a_signal_is_reported_at_the_boundary_and_the_old_handler_returns():
    before = signal.getsignal(signal.SIGUSR1)
    with Preemption(["SIGTERM", "SIGUSR1"]) as preemption:
        assert preemption.agreed() is None
        os.kill(os.getpid(), signal.SIGUSR1)  # would end the process under the default action
        assert preemption.agreed() is signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGTERM)  # the first signal is the one reported
        assert preemption.agreed() is signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) is before


def test_no_signals_means_no_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with Preemption([]) as preemption:
        assert signal.getsignal(signal.SIGTERM) is before
        assert preemption.agreed() is None


def test_the_exit_code_is_apart_from_signal_deaths_and_kubeflows_permanent_errors():
    # Kubeflow's restartPolicy ExitCode recreates pods on 128..255; 128 + n is a death by signal n
    assert 128 < PREEMPTED_EXIT_CODE <= 255
    assert PREEMPTED_EXIT_CODE - 128 not in {s.value for s in signal.Signals}
    assert Preempted("x").exit_code == PREEMPTED_EXIT_CODE


def test_an_unknown_signal_name_is_a_config_error():
    with pytest.raises(ConfigError, match="resilience.preemption_signals: 'SIGKILL' is not one"):
        parse_args(["--resilience.preemption_signals", "SIGKILL"])


def test_ctrl_c_is_a_stop_at_the_boundary_and_a_second_one_stops_at_once():
    before = signal.getsignal(signal.SIGINT)
    with Preemption([]) as preemption:  # no preemption signals: Ctrl-C is still listened to
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt by default
        sig = preemption.agreed()
        assert sig is signal.SIGINT and preemption.is_ctrl_c(sig)
        with pytest.raises(Interrupted, match="stopped by a second Ctrl-C"):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(100):  # the handler runs at the next bytecode boundary
                pass
    assert signal.getsignal(signal.SIGINT) is before
    assert Interrupted("x").exit_code == INTERRUPTED_EXIT_CODE == 128 + signal.SIGINT


def test_sigint_named_as_a_preemption_signal_is_a_preemption():
    with Preemption(["SIGINT"]) as preemption:
        os.kill(os.getpid(), signal.SIGINT)
        sig = preemption.agreed()
        assert sig is signal.SIGINT and not preemption.is_ctrl_c(sig)
        os.kill(os.getpid(), signal.SIGINT)  # a second one is no different
        assert preemption.agreed() is signal.SIGINT
