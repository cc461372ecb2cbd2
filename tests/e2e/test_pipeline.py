"""Pipeline parallelism in real processes (gloo on CPU): exact gradients of every schedule
(tests/helpers/pp_worker.py in 2 processes), and train.py runs in 2 and 4 CPU processes whose
per-step losses match the run without pipelining. The stage split and its validation are checked
in-process in tests/unit/distributed/test_pipeline.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launcher import cache_env, pooled
from repo_paths import HELPERS, ROOT

from torchtitan.distributed import pipeline

STEP_RE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)\s+grad_norm:\s+([0-9.]+)")


def _env(tmp: Path) -> dict[str, str]:
    return dict(
        os.environ,
        **cache_env(tmp),
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )


def _torchrun(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--local-ranks-filter=0",
        "--role=rank",
        "--tee=3",
    ]


def _train(pools, tmp: Path, nproc: int, *args: str) -> tuple[dict[int, tuple[float, float]], str]:
    """``{step: (loss, grad_norm)}`` of a short deterministic debug run in the session's warm
    pool of ``nproc`` ranks, and its rank-0 log."""
    out = pooled(
        pools,
        tmp,
        "--metrics.enable_tensorboard=false",
        "--debug.deterministic",
        "--debug.seed",
        "42",
        "--metrics.log_freq",
        "1",
        "--training.local_batch_size",
        "4",
        "--training.seq_len",
        "64",
        "--training.steps",
        "3",
        *args,
        ngpu=nproc,
    )
    steps = {int(s): (float(loss), float(g)) for s, loss, g in STEP_RE.findall(out.stdout)}
    assert sorted(steps) == [1, 2, 3], out.stdout[-3000:]
    return steps, out.stdout


def _assert_same_run(got: dict, want: dict) -> None:
    assert got[1][0] == pytest.approx(want[1][0], abs=1e-4), (got, want)
    assert got[1][1] == pytest.approx(want[1][1], abs=1e-3), (
        got,
        want,
    )  # grad norm over all stages
    for step in want:
        assert got[step][0] == pytest.approx(want[step][0], abs=2e-3), (got, want)


@pytest.fixture(scope="module")
def single(pools, tmp_path_factory):
    """The reference: one process, no pipelining; local batch 4."""
    return _train(pools, tmp_path_factory.mktemp("single"), 1)[0]


@pytest.fixture(scope="module")
def single_batch_8(pools, tmp_path_factory):
    """One process, global batch 8 as two accumulated local batches of 4."""
    return _train(
        pools, tmp_path_factory.mktemp("single8"), 1, "--training.global_batch_size", "8"
    )[0]


@pytest.mark.slow
def test_every_schedule_gives_the_unsplit_gradients(tmp_path):
    cmd = [*_torchrun(2), str(HELPERS / "pp_worker.py")]
    out = subprocess.run(
        cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = re.findall(r"RESULT (\S+) (\S+) (\S+) (\S+)", out.stdout)
    assert [r[0] for r in results] == list(pipeline.SCHEDULES), out.stdout
    for schedule, loss, ref_loss, grad_err in results:
        assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6), schedule
        assert float(grad_err) < 1e-6, (schedule, grad_err)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, microbatch_size, stage_log",
    [
        ("GPipe", 2, "stage 1 (pp rank 1): layers 3-5 + norm + output"),
        ("1F1B", 1, "stage 0 (pp rank 0): tok_embeddings + layers 0-2"),
        # the embedding and norm + output count as a layer each (upstream's split): 1-2-2-1
        ("Interleaved1F1B", 1, "stage 2 (pp rank 0): layers 3-4; stage 3 (pp rank 1): layer 5 +"),
        ("ZBVZeroBubble", 1, "stage 2 (pp rank 1): layers 3-4; stage 3 (pp rank 0): layer 5 +"),
    ],
    ids=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"],
)
def test_train_py_pipelined_losses_match_one_process(
    pools, tmp_path, single, schedule, microbatch_size, stage_log
):
    steps, stdout = _train(
        pools,
        tmp_path,
        2,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.pipeline_parallel_microbatch_size",
        str(microbatch_size),
    )
    assert "world_size=2 dp_replicate=1 dp_shard=1 cp=1 tp=1 pp=2" in stdout
    assert f"Pipeline schedule {schedule}:" in stdout and stage_log in stdout
    _assert_same_run(steps, single)


@pytest.mark.slow
def test_train_py_pipeline_with_gradient_accumulation(pools, tmp_path, single_batch_8):
    steps, stdout = _train(
        pools,
        tmp_path,
        2,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--training.global_batch_size",
        "8",
    )
    assert "local 4 x dp 1 x 2 accumulation steps" in stdout
    _assert_same_run(steps, single_batch_8)


@pytest.mark.slow
def test_train_py_pipeline_with_fsdp_in_four_processes(pools, tmp_path, single_batch_8):
    steps, stdout = _train(pools, tmp_path, 4, "--parallelism.pipeline_parallel_degree", "2")
    assert "world_size=4 dp_replicate=1 dp_shard=2 cp=1 tp=1 pp=2" in stdout
    assert "Applied FSDP" in stdout
    _assert_same_run(steps, single_batch_8)
