"""Run by tests/e2e/test_layout_sweep.py under torchrun: many layouts in one set of processes.

``layout_sweep_worker.py CASES_JSON`` reads ``{"common": [...], "cases": {id: [args...]}}`` and,
for each case in turn, runs ``train.py``'s own ``train()`` with ``common + args + --job.dump_folder
OUT/<id>`` in the process group that torchrun started once: the same code a launch runs, without
paying for four interpreters and a process group per layout. Each case builds its own device mesh,
on the process groups earlier cases made for the same ranks (``pool.SharedMeshGroups``).
Every rank writes ``OUT/<id>/rank_<R>.done`` after the case trains, or ``rank_<R>.failed`` with the
traceback: when every rank raised the sweep goes on; a rank that raised alone leaves its peers
waiting until the process group's timeout (``comm.*_timeout_seconds``) ends them.
"""

from __future__ import annotations

import gc
import json
import sys
import traceback
from pathlib import Path

import torch.distributed as dist
from pool import share_mesh_groups

import train
from torchtitan.config.parse import parse_args
from torchtitan.observability.log import init_logger, logger


def run_case(case_id: str, args: list[str], out: Path, shared) -> None:
    folder = out / case_id
    shared.new_case()
    try:
        train.train(parse_args([*args, "--job.dump_folder", str(folder)]))
        status, text = "done", ""
    except Exception:
        status, text = "failed", traceback.format_exc()
    finally:
        for handler in logger.handlers[1:]:  # the case's log file
            handler.close()
        del logger.handlers[1:]
        gc.collect()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank_{dist.get_rank()}.{status}").write_text(text)
    print(f"CASE {case_id} {status}", flush=True)
    dist.barrier()


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    init_logger()
    shared = share_mesh_groups()
    for case_id, args in spec["cases"].items():
        run_case(case_id, [*spec["common"], *args], out, shared)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
