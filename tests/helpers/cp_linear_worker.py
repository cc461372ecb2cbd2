"""Run by tests/e2e/test_context_parallel.py under torchrun (CPU processes over gloo): the
context-parallel Gated DeltaNet pieces (``distributed/context_parallel_linear.py``) against the
same pieces on whole sequences in one process.

Every rank builds the same random inputs for whole sequences, keeps its context-parallel part
(chunks ``r`` and ``2 cp - 1 - r``), runs the convolution and the delta rule forward and
backward, causal and (cases ending ``_docs``) with documents starting inside chunks and on a
chunk's first position. Rank 0 compares the gathered outputs and input gradients with the
whole-sequence run, one line each::

    RESULT <case> <output err> <gradient err>
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.distributed.context_parallel import shard_sequence, unshard_sequence
from torchtitan.distributed.context_parallel_linear import (
    ContextParallelConv,
    ContextParallelDeltaRule,
)
from torchtitan.models.common.gated_deltanet import CausalConv, DeltaRule, l2_normalize

B, T, H, DK, DV, CHANNELS, KERNEL = 2, 48, 4, 8, 6, 10, 4


def documents(cp: int) -> torch.Tensor:
    """Row 0: starts at 5 and on the first position of chunk 1 (T / 2cp) and of the last chunk;
    row 1: one document."""
    c = T // (2 * cp)
    ids = torch.zeros(B, T, dtype=torch.int64)
    for p in (5, c, T - c):
        ids[0, p:] += 1
    return ids


def gather(x: torch.Tensor, cp: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous())
    return unshard_sequence(torch.stack(parts), cp, dim=1)


def run(name: str, inputs: list[torch.Tensor], local_fn, whole_fn, cp: int, rank: int) -> None:
    """``inputs``: sequence tensors (dim 1) to shard, then any whole ones (a weight)."""
    g = torch.Generator().manual_seed(5)
    leaves = [x.clone().requires_grad_() for x in inputs]
    ref = whole_fn(*leaves)
    dout = torch.randn(ref.shape, generator=g)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    mine = [
        (shard_sequence(x, cp, rank) if x.dim() > 2 or x.shape[1] == T else x)
        .detach()
        .requires_grad_()
        for x in inputs
    ]
    out = local_fn(*mine)
    grads = torch.autograd.grad(out, mine, shard_sequence(dout, cp, rank))
    out_err = (gather(out.detach(), cp) - ref).abs().max().item()
    grad_err = 0.0
    for got, want, x in zip(grads, ref_grads, inputs):
        if x.dim() > 2 or x.shape[1] == T:  # a sequence input: gather it
            got = gather(got, cp)
        else:  # a weight: each rank's part of its gradient, summed
            dist.all_reduce(got)
        grad_err = max(grad_err, ((got - want).abs().max() / want.abs().max()).item())
    if rank == 0:
        print(f"RESULT {name} {out_err:.3e} {grad_err:.3e}")


def main() -> None:
    dist.init_process_group("gloo")
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(B, T, H, DK, generator=g)) * DK**-0.5
    k = l2_normalize(torch.randn(B, T, H, DK, generator=g))
    v = torch.randn(B, T, H, DV, generator=g)
    decay = -F.softplus(torch.randn(B, T, H, generator=g) - 4)  # weak: states carry far
    beta = torch.rand(B, T, H, generator=g)
    x, weight = torch.randn(B, T, CHANNELS, generator=g), torch.randn(CHANNELS, KERNEL, generator=g)
    for docs in (None, documents(cp)):
        suffix = "" if docs is None else "_docs"
        local_docs = None if docs is None else shard_sequence(docs, cp, rank)
        for chunk in (4, 64):  # the rule's own chunks: within a CP chunk, and longer than one
            cp_rule = ContextParallelDeltaRule(dist.group.WORLD, chunk_size=chunk)
            run(
                f"rule_chunk{chunk}{suffix}",
                [q, k, v, decay, beta],
                lambda *a, r=cp_rule, d=local_docs: r(*a, d),
                lambda *a, c=chunk, d=docs: DeltaRule(c)(*a, d),
                cp,
                rank,
            )
        cp_conv = ContextParallelConv(dist.group.WORLD)
        run(
            f"conv{suffix}",
            [x, weight],
            lambda a, w, m=cp_conv, d=local_docs: m(a, w, d),
            lambda a, w, d=docs: CausalConv()(a, w, d),
            cp,
            rank,
        )
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as cp_worker.py: skip the gloo teardown at exit


if __name__ == "__main__":
    main()
