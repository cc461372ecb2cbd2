"""Downstream evaluation (``[eval]``) under every layout scores as one process.

The debug model trains 4 steps with ``[eval]`` on the shipped task files (tests/assets/eval:
ARC, HellaSwag, PIQA and Winogrande layouts) in the session's warm pools: FSDP 2, TP 2 (the
vocab-parallel loss per row), PP 2 (the schedule forward-only, each row's sum from the last
stage), CP 2 (each rank's chunks, summed) against one process, and the Qwen3-MoE debug model
under EP 2 against one process: every document's ``acc`` and ``acc_norm`` the same, every
choice's log-likelihood within 1e-4. The scores against lm-eval itself are
tests/e2e/test_lm_eval_oracle.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from downstream_runs import TASKS, TRAIN_ARGS, assert_scored, samples
from launcher import PP2_1F1B, expert_parallel, local_batch, pooled, tensorboard_scalars
from repo_paths import ROOT


def _run(pools, tmp_path: Path, ngpu: int, *args: str, config: str | None = None) -> Path:
    out = pooled(pools, tmp_path, *TRAIN_ARGS, *args, ngpu=ngpu, config=config)
    assert_scored(out.stdout)
    return tmp_path / "out"


@pytest.fixture(scope="module")
def one_process(pools, tmp_path_factory):
    out = _run(pools, tmp_path_factory.mktemp("one"), 1, *local_batch(8))
    arc = samples(out)["arc_easy"]  # TensorBoard has the scores too
    acc = tensorboard_scalars(out, "eval/arc_easy/acc")
    assert acc == {4: pytest.approx(sum(s["acc"] for s in arc) / len(arc))}
    return out


def _assert_as_one_process(layout: str, out: Path, one_process: Path) -> None:
    """Every document's scores those of one process, every log-likelihood within 1e-4."""
    ours, base = samples(out), samples(one_process)
    worst = 0.0
    for task in TASKS:
        for mine, one in zip(ours[task], base[task], strict=True):
            assert (mine["acc"], mine["acc_norm"]) == (one["acc"], one["acc_norm"]), task
            worst = max(worst, *(abs(a - b) for a, b in zip(mine["lls"], one["lls"])))
    print(f"\n{layout}: max |log-likelihood diff| vs one process {worst:.2e}")
    assert worst < 1e-4


LAYOUTS = {
    "fsdp2": (2, local_batch(4)),
    "tp2": (2, [*local_batch(8), "--parallelism.tensor_parallel_degree", "2"]),
    "pp2": (2, [*local_batch(8), *PP2_1F1B]),
    "cp2": (2, [*local_batch(8), "--parallelism.context_parallel_degree", "2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_scores_as_one_process(pools, one_process, tmp_path, layout):
    ngpu, args = LAYOUTS[layout]
    _assert_as_one_process(layout, _run(pools, tmp_path, ngpu, *args), one_process)


@pytest.mark.slow
def test_expert_parallel_scores_as_one_process(pools, tmp_path):
    """The Qwen3-MoE debug model: EP 2 (the experts split over the two ranks, tokens sent to
    them and back) against one process."""
    config = str(ROOT / "train_configs" / "qwen3_moe_debug.toml")
    one = _run(pools, tmp_path / "one", 1, *local_batch(8), config=config)
    ep = _run(pools, tmp_path / "ep2", 2, *local_batch(4), *expert_parallel(2), config=config)
    _assert_as_one_process("ep2", ep, one)
