"""Run by tests/e2e/test_context_parallel.py under torchrun: CPU processes over gloo, or with
``--cuda`` one process per GPU over NCCL (one GPU is enough: a single rank still holds two
chunks, so the merge of a causal and a full block runs on the GPU kernels).

Every rank builds the same random queries, keys and values for whole sequences, keeps its
context-parallel part of them, and runs the all-gather attention forward and backward, causal
and (cases ending ``_docs``) block-causal within documents whose boundaries fall inside and
across the chunks; the ``sinks`` cases with attention sinks and sliding windows (gpt-oss),
against ``sink_attention`` (their gradient errors include the sinks'). Rank 0 compares the gathered outputs and gradients with float32 SDPA (causal,
or with the block-causal mask) on the whole sequences, next to the error of plain SDPA in the
case's dtype (the bar for 16-bit cases), one line each::

    RESULT <case> <cp output err> <cp gradient err> <sdpa output err> <sdpa gradient err>
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchtitan.distributed.context_parallel import (
    ContextParallelAttention,
    shard_sequence,
    unshard_sequence,
)
from torchtitan.models.common.attention import document_mask
from torchtitan.models.common.sink_window import sink_attention, sliding_window_mask

# (name, batch, query heads, kv heads, sequence length, head dim, dtype); a head dim pair
# ``(qk, v)``: narrower values and a softmax scale of its own, as multi-head latent attention has
CASES = [
    ("mha", 3, 4, 4, 16, 8, torch.float32),
    ("mla", 2, 4, 4, 16, (12, 8), torch.float32),
    ("gqa", 1, 4, 2, 24, 16, torch.float32),
    ("gqa_bf16", 2, 8, 2, 16, 8, torch.bfloat16),
]
CUDA_CASES = [  # flash (16-bit) and memory-efficient (float32) kernels, Llama-like head dim
    ("cuda_bf16", 2, 8, 2, 256, 64, torch.bfloat16),
    ("cuda_fp16", 1, 4, 4, 128, 64, torch.float16),
    ("cuda_fp32", 1, 8, 2, 96, 64, torch.float32),
    ("cuda_mla_bf16", 2, 8, 8, 128, (192, 128), torch.bfloat16),
]
MLA_SCALE = 0.3  # not 1 / sqrt(head dim)
# gpt-oss's attention: a sink logit per query head, and a sliding window (in keys, the query's
# own included) shorter than a chunk, longer than one (reaching into chunks other ranks hold),
# or none; (name, batch, query heads, kv heads, sequence length, head dim, dtype, window)
SINK_CASES = [
    ("sinks", 2, 4, 2, 16, 8, torch.float32, None),
    ("sinks_window3", 2, 4, 2, 32, 8, torch.float32, 3),
    ("sinks_window11", 1, 4, 1, 32, 8, torch.float32, 11),
    ("sinks_window5_bf16", 2, 8, 2, 32, 8, torch.bfloat16, 5),
]
CUDA_SINK_CASES = [("cuda_sinks_window128_bf16", 2, 8, 2, 512, 64, torch.bfloat16, 128)]


def reference(q, k, v, doc_ids=None, scale=None, sinks=None, window=None):
    if sinks is not None:
        t = q.shape[2]
        mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            mask = sliding_window_mask(t, window, q.device)
        if doc_ids is not None:
            mask = mask & document_mask(doc_ids)
        return sink_attention(q, k, v, sinks, mask, scale)
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    mask = document_mask(doc_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def documents(b: int, t: int, g: torch.Generator) -> torch.Tensor:
    """Document ids ``[b, t]``: rows of 2, 4 and 1 documents (in turn) cut at random."""
    rows = []
    for i in range(b):
        cuts = torch.randperm(t - 1, generator=g)[: (1, 3, 0)[i % 3]] + 1
        starts = torch.zeros(t, dtype=torch.int32)
        starts[cuts] = 1
        rows.append(starts.cumsum(0, dtype=torch.int32))
    return torch.stack(rows)


def gather(x: torch.Tensor, cp: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x.contiguous())
    return unshard_sequence(torch.stack(parts), cp, dim=2)


def run_case(name, b, h, h_kv, t, d, dtype, window=False, device="cpu", docs=False) -> None:
    """``window``: False, no sinks; otherwise sinks, and the window (None: none)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    d, dv = d if isinstance(d, tuple) else (d, d)
    scale = MLA_SCALE if dv != d else None
    shapes = ((h, d), (h_kv, d), (h_kv, dv))
    q, k, v = (torch.randn(b, n, t, e, generator=g).to(device, dtype) for n, e in shapes)
    dout = torch.randn(b, h, t, dv, generator=g).to(device, dtype)
    doc_ids = documents(b, t, g).to(device) if docs else None
    options = {}
    if window is not False:  # sinks around the logits' size, so that they matter
        sinks = (torch.randn(h, generator=g) + 1.0).to(device, dtype)
        options = {"sinks": sinks, "window": window}

    exact, exact_grads = sdpa_with_grads(
        q.float(), k.float(), v.float(), dout.float(), doc_ids, scale, options, float
    )
    plain, plain_grads = sdpa_with_grads(q, k, v, dout, doc_ids, scale, options)

    mine = [shard_sequence(x, cp, rank, dim=2).detach().requires_grad_() for x in (q, k, v)]
    kernel = ContextParallelAttention(dist.group.WORLD)
    # the model hands the kernel its part of the document ids, which mask_for gathers
    mask = None if doc_ids is None else kernel.mask_for(shard_sequence(doc_ids, cp, rank))
    leaves = {n: x.detach().clone().requires_grad_() for n, x in options.items() if n == "sinks"}
    out = kernel(*mine, mask, scale, **{**options, **leaves})
    out.backward(shard_sequence(dout, cp, rank, dim=2))
    cp_out = gather(out.detach(), cp)
    cp_grads = [gather(m.grad, cp) for m in mine]
    if leaves:  # each rank's part of the sinks' gradient: its queries'
        dist.all_reduce(leaves["sinks"].grad)
        cp_grads.append(leaves["sinks"].grad)
    if rank == 0:
        errs = (
            err(cp_out, exact),
            max(err(a, b) for a, b in zip(cp_grads, exact_grads)),
            err(plain, exact),
            max(err(a, b) for a, b in zip(plain_grads, exact_grads)),
        )
        print(f"RESULT {name}{'_docs' if docs else ''} " + " ".join(f"{e:.3e}" for e in errs))


def sdpa_with_grads(q, k, v, dout, doc_ids=None, scale=None, options=None, cast=None):
    """The reference's output and gradients (the sinks' last, if any); ``cast``: the sinks'."""
    options = dict(options or {})
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    if "sinks" in options:
        sinks = options["sinks"].float() if cast is float else options["sinks"]
        options["sinks"] = sinks.clone().requires_grad_()
        leaves.append(options["sinks"])
    out = reference(*leaves[:3], doc_ids, scale, **options)
    out.backward(dout)
    return out.detach(), [x.grad for x in leaves]


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def main() -> None:
    if "--cuda" in sys.argv:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        for case in CUDA_CASES + CUDA_SINK_CASES:
            for docs in (False, True):
                run_case(*case, device="cuda", docs=docs)
    else:
        dist.init_process_group("gloo")
        for case in CASES + SINK_CASES:
            for docs in (False, True):
                run_case(*case, docs=docs)
    dist.barrier()
    dist.destroy_process_group()
    # Every result is printed and every rank passed the barrier. Skip the interpreter's teardown:
    # with 4 gloo ranks, destroying the functional collectives' group objects at exit aborted one
    # rank now and then ("terminate called without an active exception"), after the work was done.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
