"""The warm worker pool itself (tests/helpers/pool.py): a case that raises, one that hangs, and one
that leaves state behind each fail alone, and the next case passes in a clean pool."""

from __future__ import annotations

import pytest
from launcher import launch, tensorboard_scalars, train_env
from pool import CaseFailed, WorkerPool

pytestmark = pytest.mark.slow

FRESH = {"random": None, "groups": 0, "graphs": 0, "scratch_empty": True}


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(2, case_timeout_s=60, grace_s=3)
    yield p
    p.shutdown()


def _fresh(pool: WorkerPool) -> None:
    """The next case passes and finds a clean state, the same on every rank."""
    seen = pool.run("pool_cases:state")
    assert seen[0] == seen[1]
    assert {**seen[0], "random": None} == FRESH
    assert pool.run("pool_cases:rank_sum") == [1.0, 1.0]


def test_cases_run_on_every_rank_with_the_same_fresh_state(pool):
    assert pool.run("pool_cases:rank_sum") == [1.0, 1.0]
    first = pool.run("pool_cases:state")
    assert pool.run("pool_cases:state") == first  # reseeded: the same numbers every case
    _fresh(pool)


def test_a_case_that_raises_fails_with_its_traceback_and_the_next_passes(pool):
    starts = pool.starts
    with pytest.raises(CaseFailed) as e:
        pool.run("pool_cases:raise_on_rank", 1)
    assert "rank 1 raised" in str(e.value) and "ValueError: rank 1 gives up" in str(e.value)
    assert "rank 0 hung" in str(e.value)  # waiting in the all-reduce rank 1 never joined
    _fresh(pool)
    assert pool.starts == starts + 1  # the stuck rank was killed and the pool started again


def test_a_case_that_hangs_fails_after_its_timeout_and_the_next_passes(pool):
    with pytest.raises(CaseFailed) as e:
        pool.run("pool_cases:sleep", 600, timeout_s=3)
    assert "rank 0 hung: no reply within 3 s" in str(e.value)
    _fresh(pool)


@pytest.mark.parametrize(
    "case, left",
    [
        ("leave_a_group", "1 process group(s) it created and did not destroy"),
        ("compile_something", "1 compiled graph(s) in dynamo's caches"),
    ],
)
def test_a_case_that_leaves_state_fails_and_the_next_starts_clean(pool, case, left):
    with pytest.raises(CaseFailed) as e:
        pool.run(f"pool_cases:{case}")
    assert f"rank 0 left state behind: {left}" in str(e.value)
    _fresh(pool)


def test_a_case_that_says_it_compiles_passes_and_the_next_starts_clean(pool):
    assert pool.run("pool_cases:compile_something", compiles=True) == [6.0, 6.0]
    _fresh(pool)


LAYOUT = [
    "--job.config_file",
    "train_configs/debug_model.toml",
    "--training.steps",
    "4",
    "--metrics.log_freq",
    "1",
    "--debug.seed",
    "7",
    "--debug.deterministic",
    "--parallelism.tensor_parallel_degree",
    "2",
]


def test_a_layout_in_the_pool_trains_the_losses_of_the_launcher(tmp_path):
    """train.py's train() in the pool's ranks and ``NGPU=2 ./run_llama_train.sh`` give the same
    losses, bit for bit (the layout is deterministic); a second case in the warm pool too."""
    pool = WorkerPool(2, env=train_env(tmp_path))
    try:
        first = pool.run("pool_cases:train_losses", LAYOUT, meshes=True)[0]
        again = pool.run("pool_cases:train_losses", LAYOUT, meshes=True)[0]
    finally:
        pool.shutdown()
    out = launch(tmp_path, *LAYOUT, ngpu=2)
    assert out.returncode == 0, out.stderr[-3000:]
    launched = tensorboard_scalars(tmp_path / "out")
    assert sorted(first) == [1, 2, 3, 4]
    assert first == launched and again == launched
