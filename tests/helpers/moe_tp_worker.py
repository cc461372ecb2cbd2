"""Run by tests/e2e/test_moe_parallel.py under torchrun: 2 CPU processes over gloo, tensor
parallel 2, for each MoE family named on the command line (``family@field=N``: its debug flavor
with one field changed, e.g. ``deepseek_v3@q_lora_rank=0``).

Every rank builds the family's debug model with the same weights (routers scaled up so that the
routing is spread out and its gradient matters; gpt-oss's projection and expert biases, zero at
init, drawn at random so that a bias split wrongly or added on both ranks shows) and runs one forward and backward without
parallelism (the reference), then again under the family's TP plan (sequence parallel) in each
way of holding the experts:

* ``split``: the experts split on their hidden width (``expert_tensor_parallel_degree`` = TP);
* ``whole``: expert parallel 2 over the same two ranks with whole experts
  (``expert_tensor_parallel_degree`` 1), the TP ranks splitting the routed rows.

With ``--compiled-blocks`` each block is also compiled as ``compile.enable`` does (``fullgraph``
unless the all-to-alls break the graph), with inductor, or with ``--compiled-blocks=aot_eager``
with that backend (``compile.backend``); ``--whole-only`` runs the ``whole`` layout alone. Rank 0
prints, for each, the largest error of the logits and of any gradient relative to the reference
(per tensor, over its largest magnitude), and the parameter with the largest gradient error::

    RESULT <family> <split|whole> <logits err> <grad err> <worst parameter>
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist
from norms_tp_worker import rel, step  # the same one-step run and per-tensor error

from torchtitan.config.schema import Compile
from torchtitan.distributed.parallel_dims import ParallelDims
from torchtitan.distributed.parallelize import apply_ep, compile_blocks
from torchtitan.distributed.tensor_parallel import apply_tp, decoder_block_plan
from torchtitan.distributed.utils import per_rank_compile_cache
from torchtitan.models.spec import get_model_args, get_model_spec

VOCAB = 2256


def build(name: str, state: dict | None = None) -> torch.nn.Module:
    """``name``: a family, or ``family@field=int`` (the debug flavor with one field changed)."""
    family, _, change = name.partition("@")
    overrides = {k: int(v) for k, v in [change.split("=")]} if change else {}
    args = dataclasses.replace(get_model_args(family, "debugmodel"), vocab_size=VOCAB, **overrides)
    if getattr(args, "num_mtp_layers", 0):  # tensor parallel refuses multi-token prediction
        args = dataclasses.replace(args, num_mtp_layers=0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = get_model_spec(family).cls(args)
    model.to_empty(device="cpu")
    model.init_weights()
    with torch.no_grad():
        if state is not None:
            model.load_state_dict(state)
        else:
            for name, p in model.named_parameters():
                if "router" in name:
                    p.mul_(20)
                if name.endswith("bias") and "router" not in name:  # gpt-oss's: zero at init
                    p.normal_(0.0, 0.2)
    return model


def run(family: str, dims: ParallelDims, whole: bool, compiled: str) -> None:
    """``compiled``: the blocks' torch.compile backend, or '' for eager."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=g)
    dlogits = torch.randn(2, 32, VOCAB, generator=g)
    reference = build(family)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    ref_logits, ref_grads = step(reference, tokens, dlogits)
    model = build(family, state)
    # the family's own block plan, applied as parallelize_decoder does
    block_plan = get_model_spec(family.partition("@")[0]).block_plan or decoder_block_plan
    if whole:
        apply_ep(model, dims)
    apply_tp(
        model,
        dims.sub("tp"),
        block_plan,
        loss_parallel=False,
        compiled_blocks=bool(compiled),
        experts_whole=whole,
    )
    if compiled:  # as compile.enable does
        compile_blocks(model, Compile(enable=True, backend=compiled), experts_all_to_all=whole)
    logits, grads = step(model, tokens, dlogits)
    errs = {n: rel(grads[n], ref_grads[n]) for n in ref_grads}  # collectives: every rank
    worst = max(errs, key=errs.get)
    if dist.get_rank() == 0:
        layout = "whole" if whole else "split"
        print(f"RESULT {family} {layout} {rel(logits, ref_logits):.3e} {errs[worst]:.3e} {worst}")


def main() -> None:
    per_rank_compile_cache()  # as train.py does (init_distributed)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    flags = [a.partition("=") for a in sys.argv[1:] if a.startswith("--compiled-blocks")]
    compiled = (flags[0][2] or "inductor") if flags else ""
    only_whole = "--whole-only" in sys.argv[1:]
    n = dist.get_world_size()
    split = ParallelDims(1, 1, 1, n, 1, n)
    whole = ParallelDims(1, 1, 1, n, 1, n, ep=n, etp=1)
    for dims in (split, whole):
        dims.build_mesh("cpu")
    for family in [a for a in sys.argv[1:] if not a.startswith("--")]:
        if not only_whole:
            run(family, split, whole=False, compiled=compiled)
        run(family, whole, whole=True, compiled=compiled)
    dist.barrier()  # neither rank tears its gloo pairs down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
