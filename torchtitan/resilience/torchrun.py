"""torchrun (``python -m torch.distributed.run``) with one change: it acts on a stop signal once.

Where a cluster signals every process of a job step (Slurm passes ``scancel --signal`` and its
time-limit signal to every process it tracks, the launchers and workers included), torchrun gets
the signal twice: from the cluster, and from ``run_llama_train.sh``, which passes it on because on
Kubernetes it alone gets it. torchrun raises ``SignalException`` on each one, even while it waits
for its workers to save and stop on the first. The second breaks off that wait, torchrun prints a
traceback, and then it hangs at exit on the threads that copy the workers' logs (torch 2.11 to
2.13): the job never ends and its workers' last lines are lost. A signal after the first changes
nothing (the workers have it already), so here torchrun ignores it. (A second Ctrl-C that
should stop everything at once is the launcher's: it kills the workers itself.)

Usage is torchrun's: ``python -m torchtitan.resilience.torchrun --nproc-per-node=2 train.py ...``.
"""

from __future__ import annotations

import runpy
from collections.abc import Callable
from types import FrameType

Handler = Callable[[int, FrameType | None], None]


def acting_once(handler: Handler) -> Handler:
    """``handler`` for the first signal; later ones are ignored."""
    fired = False

    def handle(signum: int, frame: FrameType | None) -> None:
        nonlocal fired
        if fired:
            return
        fired = True
        handler(signum, frame)

    return handle


def main() -> None:
    from torch.distributed.elastic.multiprocessing import api

    # torchrun installs this module attribute for each signal it handles, when it starts workers;
    # a torch without it runs unchanged
    if callable(getattr(api, "_terminate_process_handler", None)):
        api._terminate_process_handler = acting_once(api._terminate_process_handler)
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
