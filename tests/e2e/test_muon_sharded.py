"""Muon's orthogonalization of split parameters (``torchtitan/optim/muon.py``) on 4 real processes:
every split gives one process's result to the last bit, experts split on the expert dim are
orthogonalized where they are, with no collective, and matrices split by rows are shared out so
that each is orthogonalized by one rank (``tests/helpers/muon_worker.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from launcher import train_env
from repo_paths import HELPERS, ROOT


@pytest.mark.slow
def test_split_updates_are_orthogonalized_as_the_whole_and_own_experts_stay_local(tmp_path):
    """Also ``orthogonalize_all``: matrices split by rows are shared out, one rank each."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(HELPERS / "muon_worker.py"),
    ]
    env = train_env(tmp_path, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = {
        name: (equal == "1", int(collectives))
        for name, equal, collectives in (
            line.split()[1:] for line in out.stdout.splitlines() if line.startswith("RESULT")
        )
    }
    print(results)
    assert len(results) == 8, out.stdout[-3000:]
    assert all(equal for equal, _ in results.values()), results
    # only the expert dim split: each rank keeps its own experts, nothing is gathered
    for name in ("experts_ep_x_efsdp", "experts_uneven", "experts_ep"):
        assert results[name][1] == 0, (name, results)
    # a split through the matrices is gathered (and the check above could fail)
    for name in ("experts_ep_x_etp", "experts_fsdp_rows", "matrix_fsdp_x_tp", "matrix_tp"):
        assert results[name][1] > 0, (name, results)
    # a model's list: row-split matrices shared out between the 4 ranks, two all-to-alls a turn
    # of up to 4 (float32: 5 matrices, 2 turns; bfloat16: 2, 1 turn), plus the column split's
    # all-gather: 7; gathering every matrix on every rank would be 8 all-gathers
    assert results["shared_out"] == (True, 7), results
