"""Cases run on every rank of a WorkerPool: ``train`` for every pooled training run
(``launcher.pooled``), the rest for the pool's own tests (tests/e2e/test_pool.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pool import pool_scratch
from repo_paths import DEBUG_TOML


def rank_sum() -> float:
    """The sum of the ranks, by all-reduce; each rank also writes a file in its scratch folder."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    with open(os.path.join(pool_scratch(), f"rank_{dist.get_rank()}"), "w") as f:
        f.write("here")
    return float(t)


def state() -> dict:
    """What a case sees on arrival: seeded random numbers, groups, compiled graphs, scratch."""
    from pool import _groups

    return {
        "random": torch.rand(2).tolist(),
        "groups": len(_groups()),
        "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
        "scratch_empty": not os.listdir(pool_scratch()),
    }


def raise_on_rank(rank: int) -> None:
    """``rank`` raises before a collective its peers then wait in."""
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} gives up")
    dist.all_reduce(torch.ones(1))


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def leave_a_group() -> None:
    dist.new_group(ranks=list(range(dist.get_world_size())))


def compile_something() -> float:
    fn = torch.compile(lambda x: (x * 2).sum(), backend="eager")
    return float(fn(torch.ones(3)))


def train(args: list[str], dump_folder: str | None = None) -> None:
    """``train.py``'s own ``train()`` with ``args`` in the pool's process group, writing to
    ``dump_folder`` (default: the case's scratch folder), its log in ``logs/rank_R.log`` there."""
    import train as train_py
    from torchtitan.config.parse import parse_args
    from torchtitan.observability.log import init_logger, logger

    init_logger()
    if "--job.config_file" not in args:  # as run_llama_train.sh: the debug model by default
        args = ["--job.config_file", DEBUG_TOML, *args]
    try:
        train_py.train(parse_args([*args, "--job.dump_folder", dump_folder or pool_scratch()]))
    finally:
        for handler in logger.handlers[1:]:  # the case's log file
            handler.close()
        del logger.handlers[1:]


def train_losses(args: list[str]) -> dict[int, float]:
    """:func:`train` in the scratch folder; the per-step losses its TensorBoard run recorded
    (rank 0), else {}."""
    from launcher import tensorboard_scalars_all_runs

    train(args)
    if dist.get_rank() != 0:
        return {}
    return tensorboard_scalars_all_runs(Path(pool_scratch()))


def group_count() -> int:
    from pool import _groups

    return len(_groups())
