"""Measure what a real training run adds to this process's peak memory (CPU, one process).

    python tests/helpers/memory_worker.py [train.py arguments]

Prints one JSON line: ``{"peak_above_start_gib": ...}``, the peak resident set size during
``train.main`` minus the resident set size just before it, with the libraries a run uses imported
beforehand so that their code pages count in neither. Used to check scripts/estimate_memory.py.
"""

from __future__ import annotations

import json
import os
import sys

# the checkout's root (train.py, torchtitan), two folders up from tests/helpers/
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import datasets  # noqa: E402,F401  (imported before the baseline: code pages are not training memory)
import tiktoken  # noqa: E402,F401
import torch  # noqa: E402

import train  # noqa: E402
from torchtitan.observability import metrics  # noqa: E402
from torchtitan.observability.metrics import proc_status_kib  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)  # one thread: no per-thread scratch buffers in the measurement
    # The training loop resets the peak after each logged step (metrics.log_freq): keep the peak
    # of every interval before it is reset.
    peaks = []
    reset = metrics.reset_peak_memory

    def keep_peak_then_reset() -> None:
        peaks.append(proc_status_kib("VmHWM"))
        reset()

    metrics.reset_peak_memory = keep_peak_then_reset
    start = proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak (VmHWM) to the current resident set
    rc = train.main(sys.argv[1:])
    peak = max([*peaks, proc_status_kib("VmHWM")])
    print(json.dumps({"rc": rc, "peak_above_start_gib": (peak - start) / 1024**2}), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
