"""Preemption: save at an agreed step boundary and exit with code 160 when a stop signal comes.

Clusters ask a job to stop before they kill it: Kubernetes sends SIGTERM and waits the pod's
grace period, Slurm sends the signal that ``--signal`` asks for ahead of the time limit (and SIGTERM
before a preemption kill), torchrun forwards the signals it gets to its workers. A signal named by
``resilience.preemption_signals`` only sets a flag here; nothing is interrupted mid-step.

Every rank must stop after the same step, so the flags are combined: at each step boundary a rank
starts a small asynchronous all-reduce (MAX) of its flag on a gloo group of its own, and reads the
result at the next boundary, by when it has long arrived. A step never waits for it, so the check
costs nothing when no signal came; a signal is acted on at the second boundary after it at most.
Then every rank writes a synchronous checkpoint of that step and exits with ``PREEMPTED_EXIT_CODE``,
and the next start resumes from it exactly.

Ctrl-C (SIGINT) is always listened to the same way, unless ``preemption_signals`` names it: a
person stopped the run, so it ends with ``INTERRUPTED_EXIT_CODE`` (130, the shell's code for
Ctrl-C), which Slurm's requeue and Kubeflow's ``restartPolicy: ExitCode`` do not take for a
preemption. A second Ctrl-C stops at once, without saving (:class:`Interrupted`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from torchtitan.errors import TorchTitanError
from torchtitan.observability.log import logger
from torchtitan.resilience.verdict import GO_ON, Action, Verdict

PREEMPTED_EXIT_CODE = 160
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a Ctrl-C


class Preempted(TorchTitanError):
    """A stop signal came; this step's checkpoint is saved. Not a failure: start again to resume.

    The exit code is above 128, where Kubeflow's ``restartPolicy: ExitCode`` recreates a pod, and
    apart from the codes of a process killed by a signal (128 + its number: 137, 143, ...)."""

    exit_code = PREEMPTED_EXIT_CODE
    prefix = ""
    names_rank = False  # every rank stops after the same step with the same line


class Interrupted(TorchTitanError):
    """Ctrl-C: the run stopped (after saving the step, on the first one). One line, no traceback."""

    exit_code = INTERRUPTED_EXIT_CODE
    prefix = ""
    names_rank = False


class Preemption:
    """Listens from construction on (the handlers are installed in the main thread only), so
    that a signal during start-up is not lost; leaving its ``with`` block puts the previous
    handlers back. :meth:`agreed` is called once per step boundary on every rank."""

    def __init__(self, signal_names: list[str]) -> None:
        self.signals = [signal.Signals[name] for name in signal_names]
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        listened = [*self.signals, *([] if signal.SIGINT in self.signals else [signal.SIGINT])]
        several = dist.is_initialized() and dist.get_world_size() > 1
        # a group of its own: its all-reduce runs beside the training group's collectives, never
        # between them (every rank creates it at the same point of start-up)
        self._group = dist.new_group(backend="gloo") if several else None
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._work: Any = None
        if threading.current_thread() is threading.main_thread():
            for sig in listened:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(self, exc_type: Any, *rest: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if exc_type is None and self._work is not None:
            self._work.wait()  # every rank started it at the last boundary: it completes
        self._work = None
        if exc_type is None and self._group is not None:  # (on an error, the process ends)
            dist.destroy_process_group(self._group)
            self._group = None

    def is_ctrl_c(self, sig: signal.Signals) -> bool:
        """Whether stopping on ``sig`` is a person's Ctrl-C (exit 130) rather than a preemption."""
        return sig == signal.SIGINT and sig not in self.signals

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # only a flag: the handler runs between two bytecodes of whatever the main thread does
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
        elif self.is_ctrl_c(sig) and self.is_ctrl_c(self.received):
            raise Interrupted(
                "stopped by a second Ctrl-C: nothing more saved (the newest complete "
                "checkpoint, if any, stays)"
            )

    def agreed(self) -> signal.Signals | None:
        """The signal every rank agrees to stop on at this boundary, or None to train on."""
        if self._group is None:
            return self.received
        stop = None
        if self._work is not None:
            self._work.wait()
            if int(self._flag.item()) > 0:
                stop = signal.Signals(int(self._flag.item()))
        self._flag = torch.tensor([int(self.received or 0)], dtype=torch.int32)
        self._work = dist.all_reduce(
            self._flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        return stop

    def verdict(self, step: int) -> Verdict:
        """At the boundary after ``step``: go on, or stop after saving this step (every rank
        agrees; exit code 160 for a preemption, 130 for Ctrl-C)."""
        if (sig := self.agreed()) is None:
            return GO_ON
        ctrl_c = self.is_ctrl_c(sig)
        what = "Ctrl-C (again: stop at once, without saving)" if ctrl_c else sig.name
        logger.warning(f"{what} received: saving step {step} before stopping")
        if ctrl_c:
            reason, advice, error = (
                f"stopped by Ctrl-C after step {step}",
                "run the same command to resume",
                Interrupted,
            )
        else:
            reason, advice, error = (
                f"preempted by {sig.name} after step {step}",
                "start the job again to resume",
                Preempted,
            )
        return Verdict(Action.STOP, reason, advice, save=True, error=error)
