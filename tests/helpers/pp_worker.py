"""Run by tests/e2e/test_pipeline.py under torchrun (CPU processes, gloo), one process per stage rank.

For every schedule named on the command line (default: all), one training step of a tiny Llama
split into pipeline stages, with two gradient-accumulation micro-steps, must give the unsplit
model's loss and gradients. Rank 0 prints one line per schedule::

    RESULT <schedule> <pipelined loss> <reference loss> <max abs gradient difference>
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist

from torchtitan.config.schema import JobConfig
from torchtitan.distributed import pipeline
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.param_init import layout_invariant_init
from torchtitan.models.llama.model import ModelArgs, Transformer
from torchtitan.train.loss import cross_entropy_loss, token_mean
from torchtitan.train.plan import pipeline_plan

ARGS = ModelArgs(dim=32, n_layers=6, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)
LOCAL_BATCH, SEQ, ACCUM, SEED = 4, 8, 2, 7


def materialized(model: torch.nn.Module) -> torch.nn.Module:
    model.to_empty(device="cpu")
    with torch.no_grad(), layout_invariant_init(model, SEED):
        model.init_weights()
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(SEED)
    shape = (LOCAL_BATCH, SEQ)
    return [
        (torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g))
        for _ in range(ACCUM)
    ]


def reference() -> tuple[float, dict[str, torch.Tensor]]:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model = materialized(model)
    total = 0.0
    for inputs, labels in batches():
        loss = cross_entropy_loss(model(inputs), labels) / ACCUM
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters()}


def pipelined(schedule: str, pp: int, rank: int) -> tuple[float, dict[str, torch.Tensor]]:
    job = JobConfig()
    job.parallelism.pipeline_parallel_schedule = schedule
    job.training.local_batch_size = LOCAL_BATCH
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=pp, world_size=pp)
    plan = pipeline_plan(job, ARGS, dims)
    with torch.device("meta"):
        full = Transformer(ARGS)
    parts = {s: materialized(m) for s, m in pipeline.split_model(full, plan, rank).items()}
    # training's loss: each micro-batch's summed cross entropy over the step's tokens
    loss_fn = token_mean(functools.partial(cross_entropy_loss, reduction="sum"))
    divisor = LOCAL_BATCH * SEQ * ACCUM
    pipe = pipeline.Pipeline(plan, parts, torch.device("cpu"), dist.group.WORLD, loss_fn)
    total = sum(pipe.forward_backward(x, y, None, divisor).item() for x, y in batches())
    grads = {n: p.grad for m in parts.values() for n, p in m.named_parameters()}
    return total, grads


def main() -> None:
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.use_deterministic_algorithms(True)
    ref_loss, ref_grads = reference()
    for schedule in sys.argv[1:] or pipeline.SCHEDULES:
        loss, grads = pipelined(schedule, pp, rank)
        err = torch.tensor(max((g - ref_grads[n]).abs().max().item() for n, g in grads.items()))
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"RESULT {schedule} {loss:.8f} {ref_loss:.8f} {err.item():.3e}", flush=True)
    dist.barrier()  # neither rank tears its gloo pairs down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
